//! Quantised linear layers: our own SIMD kernels for the block formats of both shipped models, candle's `QMatMul` for the rest.
//!
//! candle 0.11.1 has no SIMD dot product for Q4_1, Q5_0 and Q5_1 (the formats of SmolLM2 and of gemma-3's
//! projections), so its matmul falls back to scalar code there. For those formats, Q4_0, Q8_0 and the K-quants
//! Q4_K, Q5_K and Q6_K (gemma-3's `attn_output` and `ffn_down` are Q4_K and Q6_K) [`Linear`] runs the kernels of
//! this module instead,
//! on our compute pool; every other format goes to candle's `QMatMul`.
//!
//! How a product `y = x · Wᵀ` is computed (the ggml method, on weights repacked at load time):
//!
//! ```text
//!   x rows (f32) --quantize once--> QuantizedActivations (i8 values, scale, scale·Σq, Σ of each 4 values)
//!                                              |
//!   W rows --repack once at load--> PackedWeights (16 rows interleaved per block, `packed.rs`)
//!                                              v
//!        per block of 16 rows: integer dot products, one row per lane (AVX-512 VNNI dpbusd, AVX2 maddubs+madd)
//!                   then  sum += w_scale·x_scale·dot ; offset += w_minimum·(x_scale·Σq)   for 16 rows at once
//! ```
//!
//! Work is split over output rows in groups of sixteen ([`GROUP`]): each output element is computed start to
//! finish by one thread with a fixed order of operations, so results are identical for any thread count. The
//! order is also the same whichever tile, SIMD level or scalar code computes the element, so a row's result does
//! not depend on the other rows in its batch (a prefill in one chunk or several, or a decode step, give the same
//! bits) nor on the CPU's instruction set. (A [`Linear`] over Q8_0 weights of candle's repackable shape runs
//! candle's product on VNNI CPUs instead, see [`Linear::from_arc_at`]; its bits are candle's.)
//!
//! `unsafe` is allowed in this module only, for two reasons: `std::arch` intrinsics behind runtime feature
//! detection (`is_x86_feature_detected!`), and writing disjoint output elements from several threads. Each
//! `unsafe` block says which invariant it relies on.
#![allow(unsafe_code)]

mod activation;
mod arena;
mod format;
mod packed;
pub mod pool;
mod scalar;
pub mod vector;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::num::NonZeroUsize;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{D, DType, Device, Module, Storage, Tensor};

pub use activation::{QuantizedActivations, WIDE_FACTOR};
pub use format::{BLOCK, WeightFormat};
pub use packed::{GROUP, PackedWeights};
pub use pool::ComputePool;

/// Below this many multiply-adds a product runs on the calling thread: waking the pool costs more than it saves.
const PARALLEL_THRESHOLD: usize = 64 * 1024;

/// An instruction-set level for the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SimdLevel {
    /// Portable Rust, no intrinsics.
    Scalar,
    /// AVX2 with FMA and F16C (Haswell and later).
    Avx2,
    /// AVX-512 F, BW, VL and VNNI (Ice Lake, Sapphire Rapids, Zen 4): 16 rows per register, `vpdpbusd` replaces
    /// the two-step `maddubs`/`madd`, and mask registers expand the fifth bits of Q5 blocks in one instruction.
    Avx512Vnni,
}

impl SimdLevel {
    /// Every level, slowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni];

    /// The best level this CPU supports (checked at run time).
    pub fn detect() -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|level| level.is_available())
            .unwrap_or(SimdLevel::Scalar)
    }

    /// Whether this CPU can run the level.
    pub fn is_available(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => x86::avx2_available(),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vnni => x86::avx512_vnni_available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// How many threads a product may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// The process's [`ComputePool`]: its size is fixed at first use from `CANDLE_NUM_THREADS`, else
    /// `RAYON_NUM_THREADS`, else the cores this process may use. Inside a [`ComputePool::pass`] its workers
    /// spin between products; outside one they park after each.
    Pool,
    /// Exactly this many threads, spawned for the call (for tests and comparisons; slower to start).
    Exactly(NonZeroUsize),
}

/// Errors from building or running a kernel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The weight tensor is not a matrix.
    #[error(
        "a linear weight must have two dimensions, this one has shape {shape:?}; pass a [out, in] matrix"
    )]
    NotAMatrix {
        /// The shape found.
        shape: Vec<usize>,
    },
    /// The weight's type has no kernel here.
    #[error("no kernel for weight type {dtype:?}; use candle's QMatMul for it")]
    UnsupportedFormat {
        /// The type found.
        dtype: candle_core::quantized::GgmlDType,
    },
    /// The weight bytes do not match the shape.
    #[error(
        "the weight holds {found} bytes but {rows} rows of {columns} {format:?} values need {expected}; the tensor is truncated or mislabelled"
    )]
    WrongSize {
        /// Format of the weight.
        format: WeightFormat,
        /// Output rows.
        rows: usize,
        /// Input columns.
        columns: usize,
        /// Bytes needed.
        expected: usize,
        /// Bytes present.
        found: usize,
    },
    /// The row length is not a whole number of blocks.
    #[error(
        "rows of {columns} values are not a whole number of {format:?}'s {block}-value blocks; the tensor is malformed"
    )]
    PartialBlock {
        /// Format of the weight.
        format: WeightFormat,
        /// Input columns.
        columns: usize,
        /// Weights per block of the format.
        block: usize,
    },
    /// The input or output slices do not match the matrix.
    #[error(
        "input of {input} values or output of {output} values does not fit {rows} rows through a [{out_features}, {in_features}] matrix"
    )]
    ShapeMismatch {
        /// Input values given.
        input: usize,
        /// Output values given.
        output: usize,
        /// Activation rows.
        rows: usize,
        /// Weight rows.
        out_features: usize,
        /// Weight columns.
        in_features: usize,
    },
    /// A SIMD level this CPU lacks was requested.
    #[error("the CPU does not support the {0:?} kernels; use SimdLevel::detect()")]
    LevelUnavailable(SimdLevel),
}

/// How finely a product quantises its activation rows before the integer dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ActivationPrecision {
    /// One byte per value in blocks of 32, as ggml quantises them ([`QuantizedActivations::quantize`]).
    #[default]
    Byte,
    /// A second byte per value for the first one's rounding error, about 15 bits in all
    /// ([`QuantizedActivations::quantize_wide`]): a second integer product per block, about as fast as `Byte`
    /// on one row and up to 1.5 times its time in a batch or a prefill, and close to the exact product's bits.
    /// Every output head takes it, and every gemma-3 product (`model::stage::block_precision` says why).
    Wide,
}

/// A quantised weight matrix `[out_features, in_features]` in one of the [`WeightFormat`]s, with its products.
///
/// It holds the weights repacked ([`PackedWeights`]), as many bytes as the ggml tensor they came from (4/3 as
/// many for Q4_K, 1.27 for Q5_K, 1.5 for Q6_K, whose scales it keeps as f32), which the caller may then drop: a loaded layer keeps
/// one copy of its weights.
#[derive(Debug, Clone)]
pub struct QuantizedMatrix {
    weights: Arc<PackedWeights>,
    format: WeightFormat,
    out_features: usize,
    in_features: usize,
    precision: ActivationPrecision,
}

/// A linear layer `y = x · Wᵀ` over a quantised weight matrix of shape `[out_features, in_features]`.
#[derive(Debug)]
pub struct Linear {
    inner: Backend,
    in_features: usize,
    out_features: usize,
}

#[derive(Debug)]
enum Backend {
    Ours(QuantizedMatrix, SimdLevel),
    Candle(QMatMul),
}

/// A product on candle's `QMatMul` whose rows do not depend on how many rows came with them.
///
/// candle 0.11 multiplies Q6_K weights on x86 with its repacked tiles when the input has two or more rows and
/// with a vector dot product for one row; the two sum in different orders, so a decode step differed from the
/// same position in a prefill by up to a logit after amplification through later layers (and free-running
/// greedy output left llama.cpp's where the teacher-forced logits agreed). A single row is therefore sent as
/// two copies of itself and the first result kept: every row takes the same path, at the cost of a second row
/// on a product whose time is in reading the weights. (Our kernels take Q6_K since session 25, so only a layer
/// built with [`Linear::candle_only`] still sends one here.)
///
/// Float weights (F32, F16, BF16, which candle keeps as dense tensors) go through its general matrix product,
/// whose blocking and summation order change with the number of rows. Those are multiplied one row at a time,
/// so a row gives the same bits in a decode step and in a prefill chunk of any length; float models are not
/// the fast path, and a one-row product costs what reading the weights costs.
fn candle_forward(inner: &QMatMul, input: &Tensor) -> candle_core::Result<Tensor> {
    let rows = input.elem_count() / input.dim(D::Minus1)?.max(1);
    if matches!(inner, QMatMul::Tensor(_) | QMatMul::TensorF16(_)) && rows > 1 {
        let dims = input.dims().to_vec();
        let flat = input.flatten_to(D::Minus2)?;
        let products = (0..rows)
            .map(|row| inner.forward(&flat.narrow(0, row, 1)?))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let product = Tensor::cat(&products, 0)?;
        let mut output_dims = dims;
        if let Some(last) = output_dims.last_mut() {
            *last = product.dim(D::Minus1)?;
        }
        return product.reshape(output_dims);
    }
    let row_dependent =
        matches!(inner, QMatMul::QTensor(weight) if weight.dtype() == GgmlDType::Q6K);
    if !row_dependent || rows != 1 {
        return inner.forward(input);
    }
    let dims = input.dims().to_vec();
    let pair = Tensor::cat(
        &[input.flatten_to(D::Minus2)?, input.flatten_to(D::Minus2)?],
        0,
    )?;
    let product = inner.forward(&pair)?.narrow(0, 0, 1)?;
    let mut output_dims = dims;
    if let Some(last) = output_dims.last_mut() {
        *last = product.dim(D::Minus1)?;
    }
    product.reshape(output_dims)
}

/// Where one product writes: `output[x * out_features + o]`, shared by the threads of one call.
///
/// Threads get disjoint weight-row ranges, so no two ever write the same element.
pub(crate) struct Output<'a> {
    pointer: *mut f32,
    length: usize,
    out_features: usize,
    _borrow: std::marker::PhantomData<&'a mut [f32]>,
}

impl QuantizedMatrix {
    /// Repacks a weight tensor of one of our formats, checking its shape and size.
    ///
    /// Cost: one pass over the weights; the result holds as many bytes as the tensor (more for the K-quants,
    /// see [`QuantizedMatrix`]), plus zero rows up to a multiple of [`GROUP`] rows.
    pub fn new(tensor: Arc<QTensor>) -> Result<Self, KernelError> {
        let Some(format) = WeightFormat::from_ggml(tensor.dtype()) else {
            return Err(KernelError::UnsupportedFormat {
                dtype: tensor.dtype(),
            });
        };
        let dims = tensor.shape().dims().to_vec();
        let &[out_features, in_features] = dims.as_slice() else {
            return Err(KernelError::NotAMatrix { shape: dims });
        };
        if in_features % format.ggml_block_weights() != 0 {
            return Err(KernelError::PartialBlock {
                format,
                columns: in_features,
                block: format.ggml_block_weights(),
            });
        }
        let expected = out_features * format.bytes_of(in_features);
        let found = tensor.storage_size_in_bytes();
        if found != expected || !tensor.device().is_cpu() {
            return Err(KernelError::WrongSize {
                format,
                rows: out_features,
                columns: in_features,
                expected,
                found,
            });
        }
        let bytes = tensor.data().map_err(|_| KernelError::UnsupportedFormat {
            dtype: tensor.dtype(),
        })?;
        let weights = PackedWeights::pack(format, &bytes, out_features, in_features / BLOCK);
        Ok(Self {
            weights: Arc::new(weights),
            format,
            out_features,
            in_features,
            precision: ActivationPrecision::Byte,
        })
    }

    /// The same matrix, quantising its activations at `precision` (the weights are shared, not copied).
    pub fn with_precision(mut self, precision: ActivationPrecision) -> Self {
        self.precision = precision;
        self
    }

    /// How this matrix quantises its activations.
    pub fn precision(&self) -> ActivationPrecision {
        self.precision
    }

    /// The weight format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Rows of the weight (the width of an output row).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Columns of the weight (the width of an input row).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Computes `output = input · Wᵀ` for `rows` input rows (`input.len() == rows * in_features`,
    /// `output.len() == rows * out_features`, both row-major).
    ///
    /// Cost: one pass quantising the input, then `rows * out_features * in_features` multiply-adds on integers
    /// (twice the integer ones with [`ActivationPrecision::Wide`], and an eighth of the float ones).
    /// The result depends neither on `level` nor on `threads` nor on the other rows of the batch: each output row
    /// is bit-identical to computing its input row alone, on any of these paths.
    pub fn matmul(
        &self,
        input: &[f32],
        rows: usize,
        output: &mut [f32],
        level: SimdLevel,
        threads: Threads,
    ) -> Result<(), KernelError> {
        if input.len() != rows * self.in_features || output.len() != rows * self.out_features {
            return Err(KernelError::ShapeMismatch {
                input: input.len(),
                output: output.len(),
                rows,
                out_features: self.out_features,
                in_features: self.in_features,
            });
        }
        if !level.is_available() {
            return Err(KernelError::LevelUnavailable(level));
        }
        let activations = match self.precision {
            ActivationPrecision::Byte => {
                QuantizedActivations::quantize(input, rows, self.in_features)
            }
            ActivationPrecision::Wide => {
                QuantizedActivations::quantize_wide(input, rows, self.in_features)
            }
        };
        let target = Output::new(output, self.out_features);
        let groups = self.weights.groups();
        let work = rows * self.out_features * self.in_features;
        let weights = &*self.weights;
        let run = |items: Range<usize>| run_kernel(level, weights, &activations, items, &target);
        if work < PARALLEL_THRESHOLD {
            run(0..groups);
        } else {
            run_items(threads, groups, run);
        }
        Ok(())
    }
}

impl Linear {
    /// Wraps a quantised weight tensor of shape `[out_features, in_features]`, choosing the faster backend
    /// (measurements in `docs/performance/kernels.md`):
    /// - Q4_0, Q4_1, Q5_0, Q5_1: our kernels at the best SIMD level of this CPU (candle has no SIMD for three of
    ///   them and is slower on Q4_0);
    /// - Q8_0: ours, except where candle repacks the weight for AVX-512 VNNI (rows a multiple of 256 values and a
    ///   multiple of 16 rows), which still beats ours there (2048x1536, 2 threads: one row 37.8 against 54.1 µs,
    ///   128 rows 1.96 against 3.05 ms; session 16); neither shipped model has such a tensor;
    /// - Q4_K, Q5_K and Q6_K: ours, with activations in blocks of 32 (ggml's Q8_K has one scale per 256 values), on our
    ///   pool rather than candle's (whose spinning worker this host's scheduler packed onto the caller's core);
    /// - everything else (the other K-quants, F32, F16, BF16): candle's `QMatMul`.
    pub fn from_qtensor(weight: QTensor) -> candle_core::Result<Self> {
        Self::from_arc(Arc::new(weight))
    }

    /// As [`Linear::from_qtensor`] for a shared tensor (our formats are repacked into new bytes, so only candle's
    /// formats keep sharing it): a tied output head can share `token_embd` with the
    /// embedding lookup instead of holding a second copy (179 MB for gemma-3).
    pub fn from_arc(weight: Arc<QTensor>) -> candle_core::Result<Self> {
        Self::from_arc_at(weight, SimdLevel::detect())
    }

    /// As [`Linear::from_arc`], with our kernels at `level` instead of the best this CPU runs: tests and
    /// benchmarks use it to run the AVX2 and scalar paths on a CPU that would pick a faster one.
    ///
    /// Fails with [`KernelError::LevelUnavailable`] (wrapped) when this CPU cannot run `level`.
    pub fn from_arc_at(weight: Arc<QTensor>, level: SimdLevel) -> candle_core::Result<Self> {
        if !level.is_available() {
            return Err(candle_core::Error::wrap(KernelError::LevelUnavailable(
                level,
            )));
        }
        let (out_features, in_features) = weight.shape().dims2()?;
        let ours = match WeightFormat::from_ggml(weight.dtype()) {
            Some(WeightFormat::Q8_0) => {
                let candle_repacks = level == SimdLevel::Avx512Vnni
                    && in_features % 256 == 0
                    && out_features % 16 == 0;
                !candle_repacks
            }
            Some(_) => true,
            None => false,
        };
        let inner = if ours {
            let matrix = QuantizedMatrix::new(weight).map_err(candle_core::Error::wrap)?;
            Backend::Ours(matrix, level)
        } else {
            Backend::Candle(QMatMul::from_arc(weight)?)
        };
        Ok(Self {
            inner,
            in_features,
            out_features,
        })
    }

    /// The same layer with its activations quantised at `precision`. A Q8_0 weight that candle multiplies (its
    /// repacked VNNI path, 8-bit activations) moves to our kernels for [`ActivationPrecision::Wide`], so a wide
    /// layer gives the same bits on every CPU; candle's other products (Q2_K, Q3_K, float weights) keep
    /// their own quantisation.
    pub fn with_activation_precision(self, precision: ActivationPrecision) -> Self {
        let inner = match self.inner {
            Backend::Ours(matrix, level) => Backend::Ours(matrix.with_precision(precision), level),
            Backend::Candle(QMatMul::QTensor(weight))
                if precision == ActivationPrecision::Wide
                    && WeightFormat::from_ggml(weight.dtype()).is_some() =>
            {
                match QuantizedMatrix::new(weight.clone()) {
                    Ok(matrix) => {
                        Backend::Ours(matrix.with_precision(precision), SimdLevel::detect())
                    }
                    // The tensor passed the same checks when the layer was built; keep candle's product if not.
                    Err(_) => Backend::Candle(QMatMul::QTensor(weight)),
                }
            }
            candle => candle,
        };
        Self { inner, ..self }
    }

    /// How this layer quantises its activations: [`ActivationPrecision::Byte`] also for candle's products.
    pub fn activation_precision(&self) -> ActivationPrecision {
        match &self.inner {
            Backend::Ours(matrix, _) => matrix.precision(),
            Backend::Candle(_) => ActivationPrecision::Byte,
        }
    }

    /// Wraps the weight in candle's `QMatMul` whatever its type (the comparison point for benchmarks).
    pub fn candle_only(weight: QTensor) -> candle_core::Result<Self> {
        let (out_features, in_features) = weight.shape().dims2()?;
        Ok(Self {
            inner: Backend::Candle(QMatMul::from_qtensor(weight)?),
            in_features,
            out_features,
        })
    }

    /// Multiplies `input` of shape `[..., in_features]` (f32) by the transposed weight, giving `[..., out_features]`.
    pub fn forward(&self, input: &Tensor) -> candle_core::Result<Tensor> {
        let Backend::Ours(matrix, level) = &self.inner else {
            let Backend::Candle(inner) = &self.inner else {
                unreachable!("two variants")
            };
            // candle splits this product over its own pool; ours parks meanwhile instead of spinning.
            return ComputePool::global().aside(|| candle_forward(inner, input));
        };
        let mut dims = input.dims().to_vec();
        let Some(last) = dims.last_mut() else {
            candle_core::bail!("a linear layer needs an input with at least one dimension");
        };
        if *last != self.in_features {
            candle_core::bail!(
                "input rows have {} values but the layer takes {}",
                *last,
                self.in_features
            );
        }
        *last = self.out_features;
        let rows = input.elem_count() / self.in_features;
        let input = input.to_dtype(DType::F32)?.contiguous()?;
        let mut output = vec![0f32; rows * self.out_features];
        {
            let (storage, layout) = input.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                candle_core::bail!("our quantised kernels run on the CPU only");
            };
            let start = layout.start_offset();
            let values = &cpu.as_slice::<f32>()?[start..start + rows * self.in_features];
            matrix
                .matmul(values, rows, &mut output, *level, Threads::Pool)
                .map_err(candle_core::Error::wrap)?;
        }
        Tensor::from_vec(output, dims, &Device::Cpu)
    }

    /// [`Linear::forward`] on plain rows: `input` holds `rows` rows of [`Linear::in_features`] values; the
    /// result holds `rows` rows of [`Linear::out_features`]. The same bits as `forward`, without a tensor on
    /// either side for our kernels (a decode step's products are too short to carry that cost).
    pub fn forward_rows(&self, input: &[f32], rows: usize) -> candle_core::Result<Vec<f32>> {
        if input.len() != rows * self.in_features {
            candle_core::bail!(
                "{} input values are not {rows} rows of the {} the layer takes",
                input.len(),
                self.in_features
            );
        }
        match &self.inner {
            Backend::Ours(matrix, level) => {
                let mut output = vec![0f32; rows * self.out_features];
                matrix
                    .matmul(input, rows, &mut output, *level, Threads::Pool)
                    .map_err(candle_core::Error::wrap)?;
                Ok(output)
            }
            Backend::Candle(_) => {
                let input = Tensor::from_slice(input, (rows, self.in_features), &Device::Cpu)?;
                self.forward(&input)?.flatten_all()?.to_vec1::<f32>()
            }
        }
    }

    /// The width of an input row.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The width of an output row.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Whether this layer runs our kernels (true) or candle's (false).
    pub fn uses_own_kernels(&self) -> bool {
        matches!(self.inner, Backend::Ours(..))
    }
}

impl<'a> Output<'a> {
    fn new(output: &'a mut [f32], out_features: usize) -> Self {
        Self {
            pointer: output.as_mut_ptr(),
            length: output.len(),
            out_features,
            _borrow: std::marker::PhantomData,
        }
    }

    /// Stores the product of activation row `x` with weight row `row`.
    #[inline]
    pub(crate) fn write(&self, x: usize, row: usize, value: f32) {
        let index = x * self.out_features + row;
        assert!(
            index < self.length && row < self.out_features,
            "output index out of range"
        );
        // SAFETY: the index is in bounds (checked above) of a slice borrowed mutably for 'a; each (x, row) is written
        // by exactly one thread because threads receive disjoint row ranges (see `run_items`).
        unsafe { self.pointer.add(index).write(value) }
    }
}

// SAFETY: `Output` is only a pointer into a `&mut [f32]` that outlives it; threads write disjoint elements.
unsafe impl Sync for Output<'_> {}

/// Runs the kernel of `level` over the weight groups `groups`.
fn run_kernel(
    level: SimdLevel,
    weights: &PackedWeights,
    activations: &QuantizedActivations,
    groups: Range<usize>,
    output: &Output<'_>,
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 | SimdLevel::Avx512Vnni => {
            x86::matmul_groups(level, weights, activations, groups, output)
        }
        _ => scalar::matmul_groups(weights, activations, groups, output),
    }
}

/// Calls `work` on disjoint ranges covering `0..items`, on the threads `threads` names.
fn run_items(threads: Threads, items: usize, work: impl Fn(Range<usize>) + Sync) {
    match threads {
        Threads::Pool => ComputePool::global().run(items, &work),
        Threads::Exactly(count) => {
            let count = count.get().min(items.max(1));
            let chunk = items.div_ceil(count * 8).max(1);
            let cursor = AtomicUsize::new(0);
            let take = || {
                loop {
                    let start = cursor.fetch_add(chunk, Ordering::Relaxed);
                    if start >= items {
                        break;
                    }
                    work(start..items.min(start + chunk));
                }
            };
            std::thread::scope(|scope| {
                for _ in 1..count {
                    scope.spawn(take);
                }
                take();
            });
        }
    }
}
