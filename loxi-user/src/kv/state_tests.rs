use super::*;

/// Failures count per model until that model's next success; beyond `MAX_MODELS` models they
/// are counted together, and cleared with the last named model.
#[test]
fn tokenize_failures_count_per_model_until_its_next_success() {
    let w = TokenizeWatch::default();
    w.succeeded("a");
    assert_eq!(w.failures(), TokenizeFailures::default());
    w.failed("a");
    w.failed("a");
    w.failed("b");
    w.succeeded("c");
    let f = w.failures();
    assert_eq!(
        f.models
            .iter()
            .map(|(m, n)| (m.as_str(), *n))
            .collect::<Vec<_>>(),
        [("a", 2), ("b", 1)]
    );
    w.succeeded("a");
    assert_eq!(w.failures().models.keys().collect::<Vec<_>>(), ["b"]);
    for i in 0..TokenizeWatch::MAX_MODELS + 2 {
        w.failed(&format!("m{i}"));
    }
    let f = w.failures();
    assert_eq!(
        (f.models.len(), f.other_failures),
        (TokenizeWatch::MAX_MODELS, 3),
        "b and 7 more named, 3 beyond"
    );
    w.succeeded("b");
    for i in 0..TokenizeWatch::MAX_MODELS {
        w.succeeded(&format!("m{i}"));
    }
    assert_eq!(w.failures(), TokenizeFailures::default());
}
