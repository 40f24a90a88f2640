"""Stand-ins for torch tensors in the CPU tests: what kvstream's pure-Python argument checks
read (shape, dtype, device, strides, contiguity, address), nothing more, so the checks are
tested without torch or a GPU."""


class FakeDevice:
    def __init__(self, type_="cuda", index=0):
        self.type = type_
        self.index = index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class FakeDType:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


BF16, F16, F32, I32, I64 = (FakeDType(n) for n in ("bfloat16", "float16", "float32", "int32", "int64"))
E4M3, E5M2 = FakeDType("float8_e4m3fn"), FakeDType("float8_e5m2")


_ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8,
               "float8_e4m3fn": 1, "float8_e5m2": 1}


class _FakeStorage:
    def __init__(self, nbytes):
        self._nbytes = nbytes

    def nbytes(self):
        return self._nbytes


class FakeTensor:
    """``storage_elems``: the elements of the storage from this view's first one (a view of a
    larger buffer); by default exactly what the view spans."""

    def __init__(self, shape, dtype=BF16, device=None, strides=None, ptr=1 << 20,
                 storage_elems=None):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device or FakeDevice()
        self.is_cuda = self.device.type == "cuda"
        natural, acc = [], 1
        for s in reversed(self.shape):
            natural.insert(0, acc)
            acc *= s
        self._natural = tuple(natural)
        self._strides = tuple(strides) if strides is not None else self._natural
        self._ptr = ptr
        span = 1 + sum((n - 1) * st for n, st in zip(self.shape, self._strides)) if all(
            self.shape) else 0
        self._storage_elems = span if storage_elems is None else storage_elems

    def element_size(self):
        return _ITEM_BYTES[self.dtype.name]

    def untyped_storage(self):
        return _FakeStorage(self._storage_elems * self.element_size())

    def storage_offset(self):
        return 0

    def stride(self):
        return self._strides

    def is_contiguous(self):
        return all(
            st == n for st, n, size in zip(self._strides, self._natural, self.shape) if size != 1
        )

    def data_ptr(self):
        return self._ptr

    def dim(self):
        return len(self.shape)
