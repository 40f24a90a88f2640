//! float8 e4m3 ("e4m3fn": 4 exponent bits, bias 7, 3 mantissa bits, no infinities, one NaN
//! pattern per sign, largest finite 448): the element of an fp8 KV cache, with the exact
//! conversions the host needs (references, tests, cache preparation).

/// One e4m3 value, as stored in an fp8 cache (`torch.float8_e4m3fn`).
///
/// ```
/// use kvstream::E4m3;
/// assert_eq!(E4m3::from_f32(1.0).to_f32(), 1.0);
/// assert_eq!(E4m3::from_f32(1000.0).to_f32(), 448.0); // saturates
/// assert_eq!(E4m3::from_f32(0.3).to_f32(), 0.3125); // nearest of 3 mantissa bits
/// ```
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct E4m3(pub u8);

// SAFETY: a plain byte; every bit pattern is a valid value.
unsafe impl cudarc::driver::DeviceRepr for E4m3 {}
// SAFETY: zero bits are +0.
unsafe impl cudarc::driver::ValidAsZeroBits for E4m3 {}

impl E4m3 {
    /// Largest finite magnitude.
    pub const MAX: f32 = 448.0;

    /// The value, exactly (NaN for the two NaN patterns).
    pub fn to_f32(self) -> f32 {
        let sign = if self.0 & 0x80 != 0 { -1.0 } else { 1.0 };
        let exp = (self.0 >> 3) & 0xf;
        let man = (self.0 & 7) as f32;
        if exp == 0xf && self.0 & 7 == 7 {
            return f32::NAN;
        }
        let mag = if exp == 0 {
            man / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + man / 8.0) * 2f32.powi(exp as i32 - 7)
        };
        sign * mag
    }

    /// The nearest value (ties to even), saturating to +-448 beyond the range; NaN stays NaN.
    pub fn from_f32(x: f32) -> Self {
        if x.is_nan() {
            return E4m3(0x7f);
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs();
        if a >= Self::MAX {
            return E4m3(sign | 0x7e);
        }
        if a < 2f32.powi(-6) {
            // subnormal: multiples of 2^-9 (8 of them reach the first normal, code 0x08)
            return E4m3(sign | (a * 512.0).round_ties_even() as u8);
        }
        // normal: keep 3 of f32's 23 mantissa bits, ties to even (a carry into the exponent
        // is the next binade's first value, as in the encoding)
        let bits = a.to_bits();
        let exp = ((bits >> 23) as i32) - 127;
        let man = bits & 0x7f_ffff;
        let (top, rest) = (man >> 20, man & 0xf_ffff);
        let up = rest > 0x8_0000 || (rest == 0x8_0000 && top & 1 == 1);
        let code = ((((exp + 7) as u32) << 3) + top + u32::from(up)).min(0x7e);
        E4m3(sign | code as u8)
    }
}

#[cfg(test)]
mod tests {
    use super::E4m3;

    #[test]
    fn every_finite_code_round_trips() {
        for code in 0u8..=255 {
            let e = E4m3(code);
            let v = e.to_f32();
            if code & 0x7f == 0x7f {
                assert!(v.is_nan());
                continue;
            }
            // -0 encodes as 0x80
            assert_eq!(E4m3::from_f32(v), e, "code {code:#x} value {v}");
        }
        assert_eq!(E4m3(0x7e).to_f32(), 448.0);
        assert_eq!(E4m3(0x01).to_f32(), 2f32.powi(-9));
    }

    #[test]
    fn rounds_to_nearest_even_and_saturates() {
        // between 1.0 (0x38) and 1.125 (0x39): the tie goes to the even code
        assert_eq!(E4m3::from_f32(1.0625), E4m3(0x38));
        assert_eq!(E4m3::from_f32(1.07), E4m3(0x39));
        assert_eq!(E4m3::from_f32(-1e9).to_f32(), -448.0);
        assert_eq!(E4m3::from_f32(f32::INFINITY).to_f32(), 448.0);
        assert!(E4m3::from_f32(f32::NAN).to_f32().is_nan());
    }
}
