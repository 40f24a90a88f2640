//! kvstream: decode attention for LLM inference on NVIDIA Hopper (sm_90a).
//!
//! One to eight new query tokens per request attend to a long cached K/V, contiguous or paged.
//! The kernels use the swap-AB formulation (S^T = K Q^T, O^T = V^T P^T: KV positions on the MMA
//! M dimension, the query rows of one KV head on N). Two engines: a persistent one (one CTA per
//! SM, the call's KV tiles partitioned on the device from the lengths at every call, cut units
//! merged by the CTA that finishes them last), the default for batches that fill the GPU; and
//! a split engine (one CTA per request, KV head and split, merged by an FP32 combine kernel
//! chained by programmatic dependent launch or inside a thread-block cluster) elsewhere
//! ([`plan::choose`], docs/design.md). They are CUDA
//! C++ with inline PTX, embedded here and compiled at first use by NVRTC to sm_90a CUBINs
//! (cached on disk).
//!
//! Layers, top to bottom:
//! - [`problem`]: shapes, dtype, strides; validation with errors that name the argument;
//! - [`plan`]: engine, split count, reduction mode, kernel variant, grid, workspace (every
//!   decision lives there; the measurements behind them in docs/tuning.md);
//! - [`schedule`]: the persistent engine's on-device schedule, mirrored for tests;
//! - [`kernels`] and [`jit`]: the embedded sources, their variants, NVRTC and the disk cache;
//! - [`launch`] and [`runtime`]: `cuLaunchKernelEx` with PDL / cluster attributes, loaded modules;
//! - [`decode`]: the public operation, [`Decoder`]; [`mla`]: MLA decode, [`mla::MlaDecoder`];
//!   [`merge`]: partial states merged by their LSEs ([`merge::StateMerger`]); [`context`]: what
//!   each rank of a context-parallel decode holds and decodes;
//! - [`reference`](mod@reference): the f64 CPU reference and the split/combine model the tests check against.
//!
//! ```no_run
//! use kvstream::{DType, DecodeProblem, Decoder, PlanOptions, Runtime};
//! # fn main() -> kvstream::Result<()> {
//! let rt = Runtime::new(0)?;                                  // needs an H100/H200
//! let problem = DecodeProblem::new(8, 32, 8, 128, 32768, DType::Bf16)?;
//! let decoder = Decoder::new(&rt, problem, PlanOptions::default())?;
//! println!("engine: {}", decoder.plan().mode()); // "persistent" for this batch
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod context;
pub mod decode;
pub mod error;
pub mod fp8;
pub mod jit;
pub mod kernels;
pub mod launch;
pub mod merge;
pub mod mla;
pub mod params;
pub mod plan;
pub mod problem;
pub mod reference;
pub mod runtime;
pub mod schedule;
pub mod store;

pub use decode::{DecodeTensors, Decoder, Element, Fp8Scales, KvElement, KvScale};
pub use error::{Error, Result};
pub use fp8::E4m3;
pub use plan::{DecodePlan, DeviceFacts, Engine, PlanOptions, Reduction};
pub use problem::{DType, DecodeProblem, KvDType, KvScaleLayout, KvStrides, PagedKv, Window};
pub use runtime::Runtime;
pub use store::{KvWriter, StoreTensors};
