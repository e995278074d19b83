use std::time::Duration;

use super::*;
use crate::kv::settings::KvSettings;
use crate::kv::testutil::{rule, state};
use crate::rules::store::RuleSnapshot;

/// vLLM's `/v1/models` with one base model and two adapters (the shape of
/// `serving_models.py::show_available_models`).
const VLLM_MODELS: &str = r#"{"object":"list","data":[
  {"id":"tiny-model","object":"model","root":"/models/tiny","parent":null,"max_model_len":2048},
  {"id":"sql-adapter","object":"model","root":"/adapters/sql-adapter","parent":"tiny-model"},
  {"id":"chat-adapter","object":"model","root":"/adapters/chat","parent":"tiny-model"}]}"#;

#[test]
fn adapters_are_the_entries_with_a_parent_and_configured_paths_win() {
    let a = adapters_of(VLLM_MODELS.as_bytes()).expect("a model list");
    let mut names: Vec<&str> = a.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(names, vec!["chat-adapter", "sql-adapter"]);
    let mut ids: Vec<String> = model_ids_of(VLLM_MODELS.as_bytes())
        .expect("a model list")
        .into_iter()
        .collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        ["chat-adapter", "sql-adapter", "tiny-model"],
        "every id"
    );
    assert_eq!(model_ids_of(b"{\"object\":\"error\"}"), None);
    assert_eq!(adapters_of(b"[1,2]"), None);
    let cat = LoraCatalog::new([("sql-adapter".to_owned(), "/etc/sql".to_owned())].into());
    assert_eq!(
        cat.resolve("sql-adapter"),
        Some(Adapter {
            path: "/etc/sql".into(),
            parent: None
        })
    );
    cat.set_learned(a);
    assert_eq!(
        cat.resolve("sql-adapter"),
        Some(Adapter {
            path: "/etc/sql".into(),
            parent: Some("tiny-model".into())
        })
    );
    assert_eq!(
        cat.resolve("chat-adapter").map(|a| a.path),
        Some("/adapters/chat".into())
    );
    assert_eq!(
        cat.resolve("tiny-model"),
        None,
        "a base model is no adapter"
    );
}

/// A fake engine on loopback answering `GET /v1/models` with `body` (other paths 404).
async fn fake_engine(body: &'static str) -> u16 {
    let app = axum::Router::new().route(
        "/v1/models",
        axum::routing::get(move || async move { body }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = l.local_addr().expect("addr").port();
    tokio::spawn(async move { axum::serve(l, app).await });
    port
}

#[tokio::test]
async fn the_poller_learns_the_engines_adapters_and_forgets_unloaded_ones() {
    let up = fake_engine(VLLM_MODELS).await;
    let later =
        fake_engine(r#"{"object":"list","data":[{"id":"tiny-model","root":"/m","parent":null}]}"#)
            .await;
    let (st, _reg) = state(KvSettings::default());
    assert_eq!(st.lora.lists("tiny-model"), None, "nothing polled yet");
    let snap_with = |port: u16| {
        let mut r = rule(1, 2, serde_json::json!({}));
        r.rule.endpoints[0].target_port = port;
        // The second endpoint refuses connections: a failing engine is left out of the round.
        r.rule.endpoints[1].target_port = 1;
        r.spec = crate::rules::ServiceSpec::compile(&r.rule).expect("spec");
        let mut s = RuleSnapshot::default();
        s.rules.insert(r.rule.key(), Arc::new(r));
        Arc::new(s)
    };
    let (tx, rx) = watch::channel(snap_with(up));
    let stop = CancellationToken::new();
    let task = tokio::spawn(poll_models(
        st.lora.clone(),
        rx,
        Duration::from_millis(50),
        stop.clone(),
    ));
    let mut names = Vec::new();
    for _ in 0..100 {
        names = st.lora.learned_names();
        if !names.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(names, vec!["chat-adapter", "sql-adapter"]);
    // Every listed id, base model and adapters alike; not a model no engine lists.
    assert_eq!(
        ["tiny-model", "sql-adapter", "typo-model"].map(|m| st.lora.lists(m)),
        [Some(true), Some(true), Some(false)]
    );
    assert_eq!(
        st.lora.resolve("sql-adapter"),
        Some(Adapter {
            path: "/adapters/sql-adapter".into(),
            parent: Some("tiny-model".into())
        })
    );
    tx.send(snap_with(later)).expect("send");
    for _ in 0..100 {
        names = st.lora.learned_names();
        if names.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        names.is_empty(),
        "adapters no engine lists any more: {names:?}"
    );
    assert_eq!(
        ["tiny-model", "sql-adapter"].map(|m| st.lora.lists(m)),
        [Some(true), Some(false)],
        "an unloaded adapter is no longer listed"
    );
    stop.cancel();
    task.await.expect("poller ends on shutdown");
}
