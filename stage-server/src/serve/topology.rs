//! A topology file: the stages of one chain (address and layer range each) in a small JSON file, so every
//! process of a cluster is started from the same description (`--topology FILE --stage I`).
//!
//! ```json
//! { "stages": [
//!     { "address": "10.0.0.1:7100", "layers": "0..10" },
//!     { "address": "10.0.0.2:7100", "layers": "10..20" },
//!     { "address": "10.0.0.3:7100", "layers": "20..30" } ] }
//! ```
//!
//! Stage 0's address is where its API will listen; the others are where each stage listens for the one
//! before it. The ranges must start at 0 and follow each other without a gap or an overlap.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;

/// Why a topology file was refused; each text names the file and the stage.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// The file could not be read.
    #[error("cannot read the topology file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not the JSON shape described in the module doc.
    #[error("the topology file {path} is not a topology: {message}")]
    Shape {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// The layer ranges do not chain.
    #[error("the topology file {path}: {message}")]
    Layers {
        /// The file.
        path: String,
        /// What is wrong, naming the stages.
        message: String,
    },
    /// A stage index outside the file.
    #[error("the topology file {path} lists {count} stages, so there is no stage {stage}")]
    NoSuchStage {
        /// The file.
        path: String,
        /// How many stages it lists.
        count: usize,
        /// The index asked for.
        stage: usize,
    },
}

/// One stage of a topology.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyStage {
    /// Where the stage listens.
    pub address: SocketAddr,
    /// The layers it serves.
    pub layers: Range<usize>,
}

/// The stages of one chain, stage 0 first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// The stages.
    pub stages: Vec<TopologyStage>,
}

impl Topology {
    /// Reads and checks the topology at `path`.
    pub fn load(path: &Path) -> Result<Topology, TopologyError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Read {
            path: name.clone(),
            source,
        })?;
        Topology::parse(&text, &name)
    }

    /// Parses and checks a topology's text; `name` names it in errors.
    pub fn parse(text: &str, name: &str) -> Result<Topology, TopologyError> {
        let shape = |message: String| TopologyError::Shape {
            path: name.to_owned(),
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|error| shape(error.to_string()))?;
        let entries = value["stages"]
            .as_array()
            .ok_or_else(|| shape("it has no \"stages\" array".into()))?;
        let mut stages = Vec::new();
        for (index, entry) in entries.iter().enumerate() {
            let address = entry["address"]
                .as_str()
                .ok_or_else(|| shape(format!("stage {index} has no \"address\" string")))?;
            let address: SocketAddr = address.parse().map_err(|_| {
                shape(format!(
                    "stage {index}'s address `{address}` is not an IP address and port"
                ))
            })?;
            let layers = entry["layers"]
                .as_str()
                .ok_or_else(|| shape(format!("stage {index} has no \"layers\" string (A..B)")))?;
            let layers = parse_range(layers)
                .ok_or_else(|| shape(format!("stage {index}'s layers `{layers}` are not A..B")))?;
            stages.push(TopologyStage { address, layers });
        }
        let chain = |message: String| TopologyError::Layers {
            path: name.to_owned(),
            message,
        };
        if stages.len() < 2 {
            return Err(chain("a chain needs at least two stages".into()));
        }
        if stages[0].layers.start != 0 {
            return Err(chain(format!(
                "stage 0 serves layers {}..{}, but the chain must start at layer 0",
                stages[0].layers.start, stages[0].layers.end
            )));
        }
        for (index, pair) in stages.windows(2).enumerate() {
            if pair[0].layers.end != pair[1].layers.start {
                return Err(chain(format!(
                    "stage {} serves layers {}..{} but stage {index} ends at layer {}",
                    index + 1,
                    pair[1].layers.start,
                    pair[1].layers.end,
                    pair[0].layers.end
                )));
            }
        }
        Ok(Topology { stages })
    }

    /// Stage `index`, or an error naming the file.
    pub fn stage(&self, index: usize, name: &str) -> Result<&TopologyStage, TopologyError> {
        self.stages
            .get(index)
            .ok_or_else(|| TopologyError::NoSuchStage {
                path: name.to_owned(),
                count: self.stages.len(),
                stage: index,
            })
    }

    /// The address of the stage after `index`, if any.
    pub fn next_of(&self, index: usize) -> Option<SocketAddr> {
        self.stages.get(index + 1).map(|stage| stage.address)
    }
}

fn parse_range(text: &str) -> Option<Range<usize>> {
    let (start, end) = text.split_once("..")?;
    let start: usize = start.trim().parse().ok()?;
    let end: usize = end.trim().parse().ok()?;
    (start < end).then_some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"stages": [
        {"address": "127.0.0.1:7100", "layers": "0..10"},
        {"address": "127.0.0.1:7101", "layers": "10..20"},
        {"address": "127.0.0.1:7102", "layers": "20..30"}]}"#;

    #[test]
    fn a_topology_gives_each_stage_its_layers_and_the_next_address() {
        let topology = Topology::parse(GOOD, "t.json").unwrap();
        assert_eq!(topology.stage(1, "t.json").unwrap().layers, 10..20);
        assert_eq!(topology.next_of(1), Some("127.0.0.1:7102".parse().unwrap()));
        assert_eq!(topology.next_of(2), None);
        let missing = topology.stage(3, "t.json").unwrap_err().to_string();
        assert_eq!(
            missing,
            "the topology file t.json lists 3 stages, so there is no stage 3"
        );
    }

    #[test]
    fn gaps_overlaps_and_bad_entries_are_refused_naming_the_stage() {
        let gap = GOOD.replace("\"10..20\"", "\"11..20\"");
        assert_eq!(
            Topology::parse(&gap, "t.json").unwrap_err().to_string(),
            "the topology file t.json: stage 1 serves layers 11..20 but stage 0 ends at layer 10"
        );
        let address = GOOD.replace("127.0.0.1:7101", "somewhere");
        assert!(
            Topology::parse(&address, "t.json")
                .unwrap_err()
                .to_string()
                .contains("stage 1's address `somewhere`")
        );
        let start = GOOD.replace("\"0..10\"", "\"1..10\"");
        assert!(
            Topology::parse(&start, "t.json")
                .unwrap_err()
                .to_string()
                .contains("must start at layer 0")
        );
        assert!(
            Topology::parse("[]", "t.json")
                .unwrap_err()
                .to_string()
                .contains("\"stages\"")
        );
    }
}
