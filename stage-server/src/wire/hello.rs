//! The hello each side sends when a link opens, and the checks that two hellos belong on one link.

use std::net::SocketAddr;

use super::codec::{CodecPolicy, CodecSet};
use super::frame::ErrorCode;

/// What a link is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Activations flow from a stage to the next one.
    StageLink,
    /// The last stage sends predicted tokens straight back to stage 0 (which opened the link).
    PredictionReturn,
}

/// Who a stage is and what it serves: the first frame each way on a link.
#[derive(Clone, Debug, PartialEq)]
pub struct Hello {
    /// The sender's [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION).
    pub version: u16,
    /// What the link is for.
    pub role: Role,
    /// The model's fingerprint ([`crate::model::fingerprint`]).
    pub fingerprint: [u8; 32],
    /// The sender's place in the chain (stage 0 holds the embeddings).
    pub stage_index: u16,
    /// First layer the sender runs.
    pub layer_start: u32,
    /// One past the last layer the sender runs.
    pub layer_end: u32,
    /// The model's block count.
    pub block_count: u32,
    /// The activation width, from the model's metadata (never from a flag).
    pub width: u32,
    /// The vocabulary size.
    pub vocab_size: u32,
    /// Lanes (concurrent sessions): from the side that connects, its own; in an answer, the fewest of the
    /// answering stage's and every stage's after it (passed on as the context length is), so stage 0 runs no
    /// more generations at once than the chain's narrowest stage takes, and queues the rest instead of a
    /// stage refusing them for want of a lane.
    pub lanes: u16,
    /// Tokens a lane holds: from the side that connects, its own; in an answer, the smallest of the answering
    /// stage's and every stage's after it (each passes on the least of its own and what the next one said), so
    /// stage 0 learns the chain's limit when its link opens, and refuses a prompt that does not fit before
    /// anything is sent instead of a stage failing the generation midway.
    pub context_length: u32,
    /// The activation codecs the sender accepts.
    pub codecs: CodecSet,
    /// The sender's fresh nonce; all zero without a cluster key.
    pub nonce: [u8; 16],
    /// The accepting side's proof over both nonces; `None` from the connecting side and on unkeyed links.
    pub proof: Option<[u8; 32]>,
    /// Where the last stage of the chain behind the sender takes prediction-return links, so that stage 0
    /// can have its tokens sent straight back: the last stage names itself (`--advertise`, or the address
    /// its upstream reached it at), each stage before it passes on what the next one said. `None` from the
    /// side that connects, and from a chain whose last stage did not say (tokens then come back up the chain).
    pub return_address: Option<SocketAddr>,
}

/// What is wrong between two hellos. Each text names both values and both stages, and what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Mismatch {
    /// The stages speak different protocol versions.
    #[error(
        "stage {upstream_stage} speaks stage protocol version {upstream} but stage {downstream_stage} speaks version {downstream}; run the same stage-server release on every stage"
    )]
    Version {
        /// The upstream stage.
        upstream_stage: u16,
        /// Its version.
        upstream: u16,
        /// The downstream stage.
        downstream_stage: u16,
        /// Its version.
        downstream: u16,
    },
    /// The two hellos are for different kinds of link.
    #[error(
        "stage {upstream_stage} opened a {} link but stage {downstream_stage} answered as a {} link; the address is another kind of port",
        role_name(*.upstream),
        role_name(*.downstream)
    )]
    Role {
        /// The upstream stage.
        upstream_stage: u16,
        /// Its role.
        upstream: Role,
        /// The downstream stage.
        downstream_stage: u16,
        /// Its role.
        downstream: Role,
    },
    /// The stages loaded different models.
    #[error(
        "stage {upstream_stage} serves model {} but stage {downstream_stage} serves model {}; start every stage from the same GGUF file",
        short_hex(.upstream),
        short_hex(.downstream)
    )]
    Model {
        /// The upstream stage.
        upstream_stage: u16,
        /// Its fingerprint.
        upstream: [u8; 32],
        /// The downstream stage.
        downstream_stage: u16,
        /// Its fingerprint.
        downstream: [u8; 32],
    },
    /// The stages' models have different block counts.
    #[error(
        "stage {upstream_stage} has a model of {upstream} blocks but stage {downstream_stage} has one of {downstream}; start every stage from the same GGUF file"
    )]
    BlockCount {
        /// The upstream stage.
        upstream_stage: u16,
        /// Its block count.
        upstream: u32,
        /// The downstream stage.
        downstream_stage: u16,
        /// Its block count.
        downstream: u32,
    },
    /// A stage's layer range is empty or reaches past its model's blocks.
    #[error(
        "stage {stage} claims layers {start}..{end} of a model with {block_count} blocks; give it a non-empty range inside 0..{block_count}"
    )]
    Range {
        /// The stage.
        stage: u16,
        /// Its first layer.
        start: u32,
        /// One past its last layer.
        end: u32,
        /// Its model's block count.
        block_count: u32,
    },
    /// The downstream stage starts after the upstream one ends: some layers would never run.
    #[error(
        "stage {downstream_stage} serves layers {downstream_start}..{downstream_end} but stage {upstream_stage} ends at layer {upstream_end}; layers {upstream_end}..{downstream_start} would never run, so start stage {downstream_stage} at layer {upstream_end}"
    )]
    Gap {
        /// The upstream stage.
        upstream_stage: u16,
        /// One past its last layer.
        upstream_end: u32,
        /// The downstream stage.
        downstream_stage: u16,
        /// Its first layer.
        downstream_start: u32,
        /// One past its last layer.
        downstream_end: u32,
    },
    /// The downstream stage starts before the upstream one ends: some layers would run twice.
    #[error(
        "stage {downstream_stage} serves layers {downstream_start}..{downstream_end} but stage {upstream_stage} ends at layer {upstream_end}; layers {downstream_start}..{upstream_end} would run twice, so start stage {downstream_stage} at layer {upstream_end}"
    )]
    Overlap {
        /// The upstream stage.
        upstream_stage: u16,
        /// One past its last layer.
        upstream_end: u32,
        /// The downstream stage.
        downstream_stage: u16,
        /// Its first layer.
        downstream_start: u32,
        /// One past its last layer.
        downstream_end: u32,
    },
    /// The stages' activation widths differ.
    #[error(
        "stage {upstream_stage} sends activations of width {upstream} but stage {downstream_stage} expects width {downstream}; start every stage from the same GGUF file"
    )]
    Width {
        /// The upstream stage.
        upstream_stage: u16,
        /// Its width.
        upstream: u32,
        /// The downstream stage.
        downstream_stage: u16,
        /// Its width.
        downstream: u32,
    },
    /// The stages' vocabulary sizes differ.
    #[error(
        "stage {upstream_stage} has a vocabulary of {upstream} tokens but stage {downstream_stage} has {downstream}; start every stage from the same GGUF file"
    )]
    Vocabulary {
        /// The upstream stage.
        upstream_stage: u16,
        /// Its vocabulary size.
        upstream: u32,
        /// The downstream stage.
        downstream_stage: u16,
        /// Its vocabulary size.
        downstream: u32,
    },
    /// The receiving stage does not accept every codec the sender's policy may use.
    #[error(
        "this stage sends activations as {policy} but stage {stage} accepts only {accepted}; choose a codec it accepts or upgrade it"
    )]
    Codec {
        /// The sender's policy.
        policy: CodecPolicy,
        /// The receiving stage.
        stage: u16,
        /// What it accepts.
        accepted: CodecSet,
    },
}

impl Role {
    /// The role's wire byte.
    pub(crate) fn to_wire(self) -> u8 {
        match self {
            Role::StageLink => 1,
            Role::PredictionReturn => 2,
        }
    }

    /// The role a wire byte names, if any.
    pub(crate) fn from_wire(byte: u8) -> Option<Role> {
        match byte {
            1 => Some(Role::StageLink),
            2 => Some(Role::PredictionReturn),
            _ => None,
        }
    }
}

impl Mismatch {
    /// The code of the `Error` frame that answers this mismatch.
    pub fn code(&self) -> ErrorCode {
        match self {
            Mismatch::Version { .. } => ErrorCode::Version,
            Mismatch::Role { .. } | Mismatch::Codec { .. } => ErrorCode::Protocol,
            Mismatch::Model { .. } | Mismatch::BlockCount { .. } | Mismatch::Vocabulary { .. } => {
                ErrorCode::Model
            }
            Mismatch::Range { .. } | Mismatch::Gap { .. } | Mismatch::Overlap { .. } => {
                ErrorCode::Layers
            }
            Mismatch::Width { .. } => ErrorCode::Width,
        }
    }
}

/// Checks that `downstream`, the hello of the stage serving the layers right after `upstream`'s, belongs on
/// a link with it: the same version (checked first, as the rest may mean something else in another
/// version), the same role, the same model (fingerprint, block count, width, vocabulary), both ranges
/// non-empty inside the model, and `upstream.layer_end == downstream.layer_start`.
///
/// Both sides of a link run it on the same pair (upstream's hello first), so both refuse with the same text.
pub fn check_adjacent(upstream: &Hello, downstream: &Hello) -> Result<(), Mismatch> {
    check_same_model(upstream, downstream)?;
    check_range(upstream)?;
    check_range(downstream)?;
    let gap = || Mismatch::Gap {
        upstream_stage: upstream.stage_index,
        upstream_end: upstream.layer_end,
        downstream_stage: downstream.stage_index,
        downstream_start: downstream.layer_start,
        downstream_end: downstream.layer_end,
    };
    let overlap = || Mismatch::Overlap {
        upstream_stage: upstream.stage_index,
        upstream_end: upstream.layer_end,
        downstream_stage: downstream.stage_index,
        downstream_start: downstream.layer_start,
        downstream_end: downstream.layer_end,
    };
    match downstream.layer_start.cmp(&upstream.layer_end) {
        std::cmp::Ordering::Greater => Err(gap()),
        std::cmp::Ordering::Less => Err(overlap()),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

/// Checks that two hellos come from stages of one pipeline, whatever their layers: the same version, the same
/// role, the same model (fingerprint, block count, width, vocabulary). For a prediction-return link, whose two
/// ends (stage 0 and the last stage) are not adjacent; `opener` is the hello of the side that connected.
pub fn check_same_model(opener: &Hello, answer: &Hello) -> Result<(), Mismatch> {
    let (upstream_stage, downstream_stage) = (opener.stage_index, answer.stage_index);
    if opener.version != answer.version {
        return Err(Mismatch::Version {
            upstream_stage,
            upstream: opener.version,
            downstream_stage,
            downstream: answer.version,
        });
    }
    if opener.role != answer.role {
        return Err(Mismatch::Role {
            upstream_stage,
            upstream: opener.role,
            downstream_stage,
            downstream: answer.role,
        });
    }
    if opener.fingerprint != answer.fingerprint {
        return Err(Mismatch::Model {
            upstream_stage,
            upstream: opener.fingerprint,
            downstream_stage,
            downstream: answer.fingerprint,
        });
    }
    if opener.block_count != answer.block_count {
        return Err(Mismatch::BlockCount {
            upstream_stage,
            upstream: opener.block_count,
            downstream_stage,
            downstream: answer.block_count,
        });
    }
    if opener.width != answer.width {
        return Err(Mismatch::Width {
            upstream_stage,
            upstream: opener.width,
            downstream_stage,
            downstream: answer.width,
        });
    }
    if opener.vocab_size != answer.vocab_size {
        return Err(Mismatch::Vocabulary {
            upstream_stage,
            upstream: opener.vocab_size,
            downstream_stage,
            downstream: answer.vocab_size,
        });
    }
    Ok(())
}

/// Checks that a stage whose hello is `receiver` accepts every codec `policy` may send.
pub fn check_codec(policy: CodecPolicy, receiver: &Hello) -> Result<(), Mismatch> {
    if receiver.codecs.contains_all(policy.codecs()) {
        Ok(())
    } else {
        Err(Mismatch::Codec {
            policy,
            stage: receiver.stage_index,
            accepted: receiver.codecs,
        })
    }
}

/// Refuses a hello whose range is empty or past its model's blocks.
fn check_range(hello: &Hello) -> Result<(), Mismatch> {
    if hello.layer_start < hello.layer_end && hello.layer_end <= hello.block_count {
        Ok(())
    } else {
        Err(Mismatch::Range {
            stage: hello.stage_index,
            start: hello.layer_start,
            end: hello.layer_end,
            block_count: hello.block_count,
        })
    }
}

/// The first six bytes of a fingerprint in hex: enough to tell models apart in a message.
pub(crate) fn short_hex(fingerprint: &[u8; 32]) -> String {
    fingerprint[..6]
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::StageLink => "stage",
        Role::PredictionReturn => "prediction-return",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{CodecSet, PROTOCOL_VERSION};

    fn hello(stage_index: u16, layer_start: u32, layer_end: u32) -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            role: Role::StageLink,
            fingerprint: [0xab; 32],
            stage_index,
            layer_start,
            layer_end,
            block_count: 24,
            width: 576,
            vocab_size: 49152,
            lanes: 4,
            context_length: 4096,
            codecs: CodecSet::all(),
            nonce: [0; 16],
            proof: None,
            return_address: None,
        }
    }

    #[test]
    fn adjacent_ranges_of_one_model_pass() {
        assert_eq!(
            check_adjacent(&hello(0, 0, 10), &hello(1, 10, 24)),
            Ok(()),
            "0..10 then 10..24 of the same model is a valid split"
        );
    }

    #[test]
    fn a_gap_names_both_ranges_and_the_missing_layers() {
        let error = check_adjacent(&hello(0, 0, 10), &hello(1, 12, 24)).unwrap_err();
        assert!(
            matches!(error, Mismatch::Gap { .. }),
            "a gap reported as {error:?}"
        );
        assert_eq!(error.code(), ErrorCode::Layers, "a gap is a layers error");
        assert_eq!(
            error.to_string(),
            "stage 1 serves layers 12..24 but stage 0 ends at layer 10; layers 10..12 would never run, so start \
             stage 1 at layer 10",
            "the gap text"
        );
    }

    #[test]
    fn an_overlap_is_told_apart_from_a_gap() {
        let error = check_adjacent(&hello(0, 0, 10), &hello(1, 8, 24)).unwrap_err();
        assert!(
            matches!(error, Mismatch::Overlap { .. }),
            "an overlap reported as {error:?}"
        );
    }

    #[test]
    fn the_version_is_checked_before_anything_else() {
        let mut other = hello(1, 12, 24);
        other.version = PROTOCOL_VERSION + 1;
        other.width = 1;
        let error = check_adjacent(&hello(0, 0, 10), &other).unwrap_err();
        assert!(
            matches!(error, Mismatch::Version { .. }),
            "another version must win over the other differences, got {error:?}"
        );
        assert_eq!(error.code(), ErrorCode::Version, "the version code");
    }

    #[test]
    fn a_different_model_width_or_vocabulary_is_refused() {
        let mut model = hello(1, 10, 24);
        model.fingerprint[0] = 0;
        assert!(
            matches!(
                check_adjacent(&hello(0, 0, 10), &model),
                Err(Mismatch::Model { .. })
            ),
            "another fingerprint passed"
        );
        let mut width = hello(1, 10, 24);
        width.width = 960;
        assert!(
            matches!(
                check_adjacent(&hello(0, 0, 10), &width),
                Err(Mismatch::Width { .. })
            ),
            "another width passed"
        );
        let mut vocabulary = hello(1, 10, 24);
        vocabulary.vocab_size = 7;
        assert!(
            matches!(
                check_adjacent(&hello(0, 0, 10), &vocabulary),
                Err(Mismatch::Vocabulary { .. })
            ),
            "another vocabulary passed"
        );
    }

    #[test]
    fn a_range_past_the_model_or_empty_is_refused() {
        assert!(
            matches!(
                check_adjacent(&hello(0, 0, 10), &hello(1, 10, 30)),
                Err(Mismatch::Range { stage: 1, .. })
            ),
            "layers past the model's 24 blocks passed"
        );
        assert!(
            matches!(
                check_adjacent(&hello(0, 0, 0), &hello(1, 0, 24)),
                Err(Mismatch::Range { stage: 0, .. })
            ),
            "an empty range passed"
        );
    }

    #[test]
    fn a_prediction_return_hello_on_a_stage_port_is_refused() {
        let mut opener = hello(0, 0, 10);
        opener.role = Role::PredictionReturn;
        let error = check_adjacent(&opener, &hello(1, 10, 24)).unwrap_err();
        assert!(
            matches!(error, Mismatch::Role { .. }),
            "a prediction-return hello passed as a stage link: {error:?}"
        );
        let mut answer = hello(2, 10, 24);
        answer.role = Role::PredictionReturn;
        assert_eq!(
            check_same_model(&opener, &answer),
            Ok(()),
            "a prediction return between stages of one model must pass"
        );
    }

    #[test]
    fn a_receiver_without_f16_cannot_take_auto_lossless() {
        let mut receiver = hello(1, 10, 24);
        receiver.codecs = CodecSet::default();
        receiver.codecs.insert(crate::wire::Codec::F32);
        assert_eq!(
            check_codec(CodecPolicy::F32, &receiver),
            Ok(()),
            "f32 is accepted"
        );
        let error = check_codec(CodecPolicy::AutoLossless, &receiver).unwrap_err();
        assert_eq!(
            error.to_string(),
            "this stage sends activations as auto-lossless but stage 1 accepts only f32; choose a codec it \
             accepts or upgrade it",
            "the codec text"
        );
    }
}
