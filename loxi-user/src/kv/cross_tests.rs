use super::*;

const K: fn(u64) -> BlockKey = BlockKey;

/// Places `n` cold prompts (keys `from..from + n`) on `on`; the engine publishing them is the
/// one on `published_by`'s stream.
fn place_and_publish(
    w: &mut CrossWatch,
    index: &KvIndex,
    on: Member,
    published_by: Member,
    from: u64,
    n: u64,
    now: Instant,
) {
    for k in from..from + n {
        w.placed(on, K(k), now);
        index.store(published_by, 0, &[K(k)]);
    }
}

/// Swapped streams: the first blocks of endpoint 0's placements show up on endpoint 1's
/// stream only. Two such strays are not yet a verdict; the third is, naming endpoint 1.
/// Endpoint 1's own placements land on its stream, so it is not crossed.
#[test]
fn placements_published_only_on_another_stream_are_crossed_from_the_third() {
    let index = KvIndex::new(1 << 20);
    let mut w = CrossWatch::default();
    let now = Instant::now();
    let members = [0, 1, 2];
    place_and_publish(&mut w, &index, 0, 1, 100, 2, now);
    place_and_publish(&mut w, &index, 1, 1, 200, 2, now);
    w.resolve(&index, &members, now);
    assert_eq!(w.crossed(0), None);
    assert_eq!(w.pending_len(), 0);
    place_and_publish(&mut w, &index, 0, 1, 102, 1, now);
    w.resolve(&index, &members, now);
    assert_eq!(w.crossed(0), Some((1, 3)));
    assert_eq!(w.crossed(1), None);
    assert_eq!(w.crossed(2), None);
    // Endpoint 1's stream carries endpoint 0's blocks: both inventories are suspect.
    assert_eq!(w.carries(1), Some((0, 3)));
    assert_eq!((w.carries(0), w.carries(2)), (None, None));
    assert_eq!(w.suspects(), vec![0, 1]);
}

/// One placement landing on the endpoint's own stream clears the verdict while it is among
/// the last [`OUTCOMES`]; once pushed out by strays the verdict comes back.
#[test]
fn a_landing_clears_the_verdict_until_strays_push_it_out() {
    let index = KvIndex::new(1 << 20);
    let mut w = CrossWatch::default();
    let now = Instant::now();
    let members = [0, 1];
    place_and_publish(&mut w, &index, 0, 1, 100, 4, now);
    w.resolve(&index, &members, now);
    assert_eq!(w.crossed(0), Some((1, 4)));
    place_and_publish(&mut w, &index, 0, 0, 300, 1, now);
    w.resolve(&index, &members, now);
    assert_eq!(w.crossed(0), None);
    // 7 more strays: the landing is still the oldest of the last 8.
    place_and_publish(&mut w, &index, 0, 1, 400, 7, now);
    w.resolve(&index, &members, now);
    assert_eq!(w.crossed(0), None);
    place_and_publish(&mut w, &index, 0, 1, 500, 1, now);
    w.resolve(&index, &members, now);
    assert_eq!(w.crossed(0), Some((1, OUTCOMES)));
}

/// A key published on the endpoint's own stream AND on another (a replica of a hot prompt)
/// landed; a key published nowhere stays pending within the window and is then dropped
/// unresolved (no outcome either way).
#[test]
fn a_replica_lands_and_an_unpublished_key_expires_without_an_outcome() {
    let index = KvIndex::new(1 << 20);
    let mut w = CrossWatch::default();
    let now = Instant::now();
    let members = [0, 1];
    for k in 100..103 {
        w.placed(0, K(k), now);
        index.store(1, 0, &[K(k)]);
        index.store(0, 0, &[K(k)]);
    }
    w.placed(0, K(900), now);
    w.resolve(&index, &members, now);
    assert_eq!(w.crossed(0), None);
    assert_eq!(w.pending_len(), 1);
    w.resolve(
        &index,
        &members,
        now + PROBE_WINDOW - Duration::from_millis(1),
    );
    assert_eq!(w.pending_len(), 1);
    w.resolve(&index, &members, now + PROBE_WINDOW);
    assert_eq!(w.pending_len(), 0);
    // The expired probe left no outcome: the 3 landings are the oldest of the kept 8 until
    // 8 strays have followed them.
    place_and_publish(&mut w, &index, 0, 1, 200, 7, now + PROBE_WINDOW);
    w.resolve(&index, &members, now + PROBE_WINDOW);
    assert_eq!(w.crossed(0), None);
    place_and_publish(&mut w, &index, 0, 1, 300, 1, now + PROBE_WINDOW);
    w.resolve(&index, &members, now + PROBE_WINDOW);
    assert_eq!(w.crossed(0), Some((1, OUTCOMES)));
}

/// Strays split over two other endpoints need [`MIN_STRAYS`] to one of them; a member that
/// left the rule takes its probes and outcomes with it; the pending list is bounded.
#[test]
fn strays_count_per_endpoint_and_leavers_and_overflow_are_dropped() {
    let index = KvIndex::new(1 << 20);
    let mut w = CrossWatch::default();
    let now = Instant::now();
    place_and_publish(&mut w, &index, 0, 1, 100, 2, now);
    place_and_publish(&mut w, &index, 0, 2, 200, 2, now);
    w.resolve(&index, &[0, 1, 2], now);
    assert_eq!(w.crossed(0), None);
    place_and_publish(&mut w, &index, 0, 2, 300, 1, now);
    w.resolve(&index, &[0, 1, 2], now);
    assert_eq!(w.crossed(0), Some((2, 3)));
    w.placed(0, K(999), now);
    w.resolve(&index, &[1, 2], now);
    assert_eq!(w.crossed(0), None);
    assert_eq!(w.pending_len(), 0);
    for k in 0..(MAX_PENDING as u64 + 5) {
        w.placed(1, K(10_000 + k), now);
    }
    assert_eq!(w.pending_len(), MAX_PENDING);
    w.forget(1);
    assert_eq!(w.pending_len(), 0);
}
