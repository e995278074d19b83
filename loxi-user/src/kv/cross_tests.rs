use super::*;

const K: fn(u64) -> BlockKey = BlockKey;

/// `n` new prompts (first keys `from..from + n`) sent to `on` alone, each then published on
/// `published_by`'s stream.
fn place_and_publish(w: &mut CrossWatch, on: Member, published_by: Member, from: u64, n: u64) {
    let now = Instant::now();
    for k in from..from + n {
        assert!(w.routed(on, K(k), true, now));
        w.observed(published_by, &[K(k)]);
    }
}

/// Swapped streams: the first blocks of endpoint 0's placements show up on endpoint 1's
/// stream only. Two such strays are not yet a verdict; the third is, naming endpoint 1, whose
/// stream then carries endpoint 0's blocks. Endpoint 1's own placements land on its stream;
/// endpoint 2 has no outcome.
#[test]
fn placements_published_only_on_another_stream_are_crossed_from_the_third() {
    let mut w = CrossWatch::default();
    place_and_publish(&mut w, 0, 1, 100, 2);
    place_and_publish(&mut w, 1, 1, 200, 2);
    assert_eq!(w.verdict(0, true), None);
    assert_eq!(w.pending_len(), 0);
    place_and_publish(&mut w, 0, 1, 102, 1);
    assert_eq!(
        w.verdict(0, true),
        Some(Verdict::Strays { to: 1, n: 3, of: 3 })
    );
    assert_eq!((w.verdict(1, true), w.verdict(2, true)), (None, None));
    assert_eq!(
        w.carries(1),
        Some((0, Verdict::Strays { to: 1, n: 3, of: 3 }))
    );
    assert_eq!((w.carries(0), w.carries(2)), (None, None));
    assert_eq!(w.suspects(|_| true), vec![0, 1]);
}

/// A slow engine is not outrun by a copy: a prompt also sent to another endpoint (a replica
/// seed, a concurrent copy) is no evidence, whichever stream publishes it first, and is
/// dropped at the end of the window. Sent to one endpoint alone, it lands however late within
/// the window.
#[test]
fn a_prompt_also_sent_elsewhere_is_no_evidence_and_a_slow_owner_still_lands() {
    let mut w = CrossWatch::default();
    let now = Instant::now();
    for k in 100..104 {
        assert!(w.routed(0, K(k), true, now));
        // The copy: not cold any more (predicted), but a probe of its key is pending.
        assert!(w.routed(1, K(k), false, now));
        w.observed(1, &[K(k)]);
    }
    assert_eq!((w.verdict(0, true), w.pending_len()), (None, 4));
    w.resolve(&[0, 1], now + PROBE_WINDOW);
    assert_eq!((w.verdict(0, true), w.pending_len()), (None, 0));
    // Alone: published 29 s later by its own engine, it landed.
    w.routed(0, K(500), true, now);
    w.resolve(&[0, 1], now + PROBE_WINDOW - Duration::from_secs(1));
    assert_eq!(w.pending_len(), 1);
    w.observed(0, &[K(500)]);
    assert_eq!(w.pending_len(), 0);
    // A request of a key with no probe that is not cold starts none.
    assert!(!w.routed(1, K(900), false, now));
    assert_eq!(w.pending_len(), 0);
}

/// A swapped pair under hot bursts: a prompt sent to endpoint 0 alone strays to 1; one also
/// seeded onto 1 (whose engine then publishes it on 0's stream) is ambiguous and no landing,
/// so the verdict stays.
#[test]
fn a_replica_on_the_swapped_partner_does_not_clear_the_verdict() {
    let mut w = CrossWatch::default();
    let now = Instant::now();
    place_and_publish(&mut w, 0, 1, 100, 3);
    assert!(w.verdict(0, true).is_some());
    for k in 200..206 {
        w.routed(0, K(k), true, now);
        w.routed(1, K(k), false, now);
        // Engine 0 publishes on 1's stream, engine 1 (the replica) on 0's.
        w.observed(1, &[K(k)]);
        w.observed(0, &[K(k)]);
    }
    w.resolve(&[0, 1], now + PROBE_WINDOW);
    assert_eq!(
        w.verdict(0, true),
        Some(Verdict::Strays { to: 1, n: 3, of: 3 })
    );
}

/// One placement landing clears the verdict while it is among the last [`OUTCOMES`]; once
/// pushed out by strays the verdict comes back.
#[test]
fn a_landing_clears_the_verdict_until_strays_push_it_out() {
    let mut w = CrossWatch::default();
    place_and_publish(&mut w, 0, 1, 100, 4);
    assert!(w.verdict(0, true).is_some());
    place_and_publish(&mut w, 0, 0, 300, 1);
    assert_eq!(w.verdict(0, true), None);
    place_and_publish(&mut w, 0, 1, 400, 7);
    assert_eq!(w.verdict(0, true), None);
    place_and_publish(&mut w, 0, 1, 500, 1);
    assert_eq!(
        w.verdict(0, true),
        Some(Verdict::Strays {
            to: 1,
            n: OUTCOMES,
            of: OUTCOMES
        })
    );
}

/// Placements sent to endpoint 0 alone and published on no stream of the rule within the
/// window while its stream delivered other blocks: from the third, `Unseen`; a suspect only
/// when its stream carries blocks (an engine outside the rule). While its stream is quiet (an
/// engine failing the requests, or publishing nothing) they give no outcome.
#[test]
fn placements_published_nowhere_are_unseen_from_the_third() {
    let mut w = CrossWatch::default();
    let now = Instant::now();
    for k in 0..3 {
        w.routed(0, K(k), true, now);
    }
    w.resolve(&[0, 1], now + PROBE_WINDOW);
    assert_eq!(
        (w.verdict(0, true), w.pending_len()),
        (None, 0),
        "quiet stream"
    );
    for k in 0..3 {
        w.routed(0, K(k), true, now);
    }
    // The outside engine's own traffic on endpoint 0's stream.
    w.observed_at(0, &[K(7777)], now + Duration::from_secs(1));
    w.resolve(&[0, 1], now + PROBE_WINDOW - Duration::from_millis(1));
    assert_eq!((w.verdict(0, true), w.pending_len()), (None, 3));
    w.resolve(&[0, 1], now + PROBE_WINDOW);
    assert_eq!(w.verdict(0, true), Some(Verdict::Unseen { n: 3, of: 3 }));
    assert_eq!(w.verdict(0, false), None, "an endpoint holding no block");
    assert_eq!(w.suspects(|_| false), Vec::<Member>::new());
    assert_eq!(w.suspects(|m| m == 0), vec![0]);
    place_and_publish(&mut w, 0, 0, 100, 1);
    assert_eq!(w.verdict(0, true), None);
}

/// Strays split over two other endpoints need [`MIN_EVIDENCE`] to one of them; a member that
/// left the rule takes its probes and outcomes with it; the pending list is bounded.
#[test]
fn strays_count_per_endpoint_and_leavers_and_overflow_are_dropped() {
    let mut w = CrossWatch::default();
    let now = Instant::now();
    place_and_publish(&mut w, 0, 1, 100, 2);
    place_and_publish(&mut w, 0, 2, 200, 2);
    assert_eq!(w.verdict(0, true), None);
    place_and_publish(&mut w, 0, 2, 300, 1);
    assert_eq!(
        w.verdict(0, true),
        Some(Verdict::Strays { to: 2, n: 3, of: 5 })
    );
    w.routed(0, K(999), true, now);
    w.resolve(&[1, 2], now);
    assert_eq!((w.verdict(0, true), w.pending_len()), (None, 0));
    for k in 0..(MAX_PENDING as u64 + 5) {
        w.routed(1, K(10_000 + k), true, now);
    }
    assert_eq!(w.pending_len(), MAX_PENDING);
    w.forget(1);
    assert_eq!(w.pending_len(), 0);
}
