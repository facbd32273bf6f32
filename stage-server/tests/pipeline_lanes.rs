//! The API's lanes against the chain's: a stage with fewer lanes than the API, from the start or after a
//! restart, makes the extra requests wait instead of failing them.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use stage_server::driver::{Chain, ChainOptions};
use stage_server::frontend::{ApiConfig, ApiServer, Backend};
use stage_server::model::ModelFile;
use stage_server::model::testing::TinyModel;

mod support;
use support::{START_TIMEOUT, StageChild, http, tiny};

/// The API with `lanes` lanes, running layers `0..layers_end` of `model` in front of the chain at `next`.
fn api_in_front(model: &Path, layers_end: usize, next: SocketAddr, lanes: usize) -> ApiServer {
    let mut config = ApiConfig::new("127.0.0.1:0".parse().unwrap());
    config.lanes = lanes;
    let backend = Backend::Chain {
        layers_end,
        next,
        options: ChainOptions::default(),
    };
    let api = ApiServer::start(model, backend, config).unwrap();
    api.wait_ready(START_TIMEOUT).unwrap();
    api
}

/// Sends `count` requests of 12 tokens at once; each must be answered in full.
fn all_serve_at_once(address: SocketAddr, count: usize) {
    let requests: Vec<_> = (0..count)
        .map(|index| {
            std::thread::spawn(move || {
                let request = format!(
                    r#"{{"prompt":[1,{}],"max_tokens":12,"temperature":0}}"#,
                    300 + index
                );
                http(address, "POST", "/v1/completions", &request)
            })
        })
        .collect();
    for request in requests {
        let (status, body) = request.join().unwrap();
        assert_eq!(status, 200, "{body}");
        let value: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(value["usage"]["completion_tokens"], 12, "{body}");
    }
}

#[test]
fn a_stage_with_fewer_lanes_than_the_api_makes_its_extra_requests_wait_instead_of_failing() {
    let llama = tiny("fewer-lanes", &TinyModel::llama(GgmlDType::Q4_1));
    let file = ModelFile::open(&llama).unwrap();
    // The last stage runs one generation at a time; the middle one (four lanes) passes that on in its hello.
    // Its link to the last stage is slowed so that the API's generations overlap.
    let last = StageChild::start(&llama, "3..4", None, &["--lanes", "1"]);
    let middle = StageChild::start(&llama, "2..3", Some(last.address), &["--link-delay", "10"]);
    let chain = Chain::connect(&file, 2, middle.address, ChainOptions::default()).unwrap();
    assert_eq!(chain.next_stage().lanes, 1, "the middle stage's answer");
    assert_eq!(chain.chain_lanes(), 1);
    drop(chain);
    let api = api_in_front(&llama, 2, middle.address, 3);
    let address = api.local_addr();
    let (_, metrics) = http(address, "GET", "/metrics", "");
    assert!(
        metrics.contains("stage_server_lanes 1\n"),
        "the API runs as many generations as the chain's narrowest stage: {metrics}"
    );
    // Three requests at once: the API's extra lanes wait for the chain's one instead of the last stage
    // refusing their sessions for want of a lane (a 503).
    all_serve_at_once(address, 3);
    let _ = api.shutdown(Instant::now() + Duration::from_secs(5));
}

#[test]
fn a_stage_restarted_with_fewer_lanes_leaves_no_request_failing() {
    let llama = tiny("restart-fewer-lanes", &TinyModel::llama(GgmlDType::Q4_1));
    // Its token returns are slowed so that the API's generations overlap.
    let mut last = StageChild::start(&llama, "2..4", None, &["--link-delay", "10"]);
    let address_of_last = last.address.to_string();
    let api = api_in_front(&llama, 2, last.address, 4);
    let address = api.local_addr();
    // Every lane has a link open to the stage, which said 4 lanes.
    all_serve_at_once(address, 4);
    last.kill();
    let _restarted = StageChild::start_on(
        &llama,
        "2..4",
        &address_of_last,
        None,
        &["--link-delay", "10", "--lanes", "1"],
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    while http(address, "GET", "/health", "").0 != 200 {
        assert!(
            Instant::now() < deadline,
            "/health never saw the stage back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The lanes' links from before broke with the old stage. Either the chain's probe saw the outage (the lanes
    // then drop their old links before using them) or, when the restart fell between two probes, each request
    // finds out on its first frame and tries once more on a new link; both ways the new link's hello says the
    // stage has one lane, and a request that meets it taken waits for it.
    all_serve_at_once(address, 4);
    let _ = api.shutdown(Instant::now() + Duration::from_secs(5));
}
