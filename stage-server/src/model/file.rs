//! An open GGUF model file: header and metadata read eagerly, tensor data read lazily by name.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};

use super::error::candle_message;
use super::{ModelConfig, ModelError};

/// A GGUF file whose header has been read and checked; tensors are read only when asked for.
#[derive(Debug)]
pub struct ModelFile {
    path: PathBuf,
    content: Content,
    config: ModelConfig,
}

/// Count and bytes of the tensors of one ggml type, as `inspect` prints them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorTypeSummary {
    /// The ggml type name (`Q4_1`, `F32`, ...).
    pub type_name: String,
    /// Tensors of this type.
    pub count: usize,
    /// Their data bytes.
    pub bytes: u64,
}

impl ModelFile {
    /// Opens `path`, reads the GGUF header and metadata and checks that every tensor lies inside the
    /// file (so a truncated download is reported here, naming the first tensor it cuts).
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        crate::model::gguf_check::validate(path)?;
        let file = File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let file_size = file
            .metadata()
            .map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|error| header_error(path, error))?;
        // Check every tensor's extent before anything multiplies its dimensions: a corrupt header
        // can declare dimensions whose product overflows, or data past the end of the file.
        let mut ends: Vec<(&String, u64)> = Vec::with_capacity(content.tensor_infos.len());
        for (name, info) in &content.tensor_infos {
            let format_error = |detail: String| ModelError::Format {
                path: path.to_path_buf(),
                detail,
            };
            let dims = info.shape.dims();
            let elements = dims
                .iter()
                .try_fold(1u64, |product, &dim| product.checked_mul(dim as u64))
                .ok_or_else(|| {
                    format_error(format!(
                        "tensor `{name}` has impossible dimensions {dims:?}"
                    ))
                })?;
            let block = info.ggml_dtype.block_size() as u64;
            if !elements.is_multiple_of(block) {
                return Err(format_error(format!(
                    "tensor `{name}` has {elements} values, not a whole number of {:?} blocks",
                    info.ggml_dtype
                )));
            }
            let end = (elements / block)
                .checked_mul(info.ggml_dtype.type_size() as u64)
                .and_then(|bytes| bytes.checked_add(content.tensor_data_offset))
                .and_then(|end| end.checked_add(info.offset))
                .ok_or_else(|| format_error(format!("tensor `{name}` ends past any file size")))?;
            ends.push((name, end));
        }
        ends.sort_by_key(|(name, end)| (*end, (*name).clone()));
        if let Some((name, end)) = ends.iter().find(|(_, end)| *end > file_size) {
            return Err(ModelError::Format {
                path: path.to_path_buf(),
                detail: format!(
                    "tensor `{name}` ends at byte {end} but the file has only {file_size} bytes"
                ),
            });
        }
        let config = ModelConfig::from_gguf(path, &content)?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            config,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The parsed GGUF header (metadata and tensor directory), for the tokenizer and chat template.
    pub fn content(&self) -> &Content {
        &self.content
    }

    /// A metadata string, if present.
    pub fn metadata_string(&self, key: &str) -> Option<&str> {
        match self.content.metadata.get(key) {
            Some(Value::String(text)) => Some(text),
            _ => None,
        }
    }

    /// Whether the file holds a tensor called `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor counts and bytes per ggml type, largest first.
    pub fn tensor_types(&self) -> Vec<TensorTypeSummary> {
        let mut summaries: Vec<TensorTypeSummary> = Vec::new();
        for info in self.content.tensor_infos.values() {
            let type_name = type_name(info.ggml_dtype);
            let bytes = (info.shape.elem_count() / info.ggml_dtype.block_size()
                * info.ggml_dtype.type_size()) as u64;
            match summaries.iter_mut().find(|s| s.type_name == type_name) {
                Some(summary) => {
                    summary.count += 1;
                    summary.bytes += bytes;
                }
                None => summaries.push(TensorTypeSummary {
                    type_name,
                    count: 1,
                    bytes,
                }),
            }
        }
        summaries.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.type_name.cmp(&b.type_name)));
        summaries
    }

    /// Reads tensor `name` from disk into memory.
    pub fn tensor(&self, name: &str) -> Result<QTensor, ModelError> {
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Err(ModelError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            });
        };
        let file = File::open(&self.path).map_err(|source| ModelError::Io {
            path: self.path.clone(),
            source,
        })?;
        let mut reader = BufReader::new(file);
        info.read(&mut reader, self.content.tensor_data_offset, &Device::Cpu)
            .map_err(|error| ModelError::Tensor {
                path: self.path.clone(),
                tensor: name.to_string(),
                detail: candle_message(&error),
            })
    }

    /// Where tensor `name`'s data starts in the file, its ggml type and its dimensions (outermost first).
    pub(crate) fn tensor_location(
        &self,
        name: &str,
    ) -> Result<(u64, GgmlDType, Vec<usize>), ModelError> {
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Err(ModelError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            });
        };
        Ok((
            self.content.tensor_data_offset.saturating_add(info.offset),
            info.ggml_dtype,
            info.shape.dims().to_vec(),
        ))
    }
}

/// The ggml spelling of a type (`Q4_K`, not candle's `Q4K`).
pub fn type_name(dtype: GgmlDType) -> String {
    let debug = format!("{dtype:?}");
    match debug.strip_suffix('K') {
        Some(stem) if stem.starts_with('Q') => format!("{stem}_K"),
        _ => debug,
    }
}

/// Classifies a header-reading failure: an unknown tensor type, or a malformed file.
fn header_error(path: &Path, error: candle_core::Error) -> ModelError {
    let detail = candle_message(&error);
    if detail.contains("unknown dtype") {
        ModelError::UnsupportedTensorType {
            path: path.to_path_buf(),
            detail: detail.replace("unknown dtype for tensor", "ggml type id"),
        }
    } else {
        ModelError::Format {
            path: path.to_path_buf(),
            detail,
        }
    }
}
