use std::time::Duration;

use super::*;

fn keys(v: &[u64]) -> Vec<BlockKey> {
    v.iter().map(|&k| BlockKey(k)).collect()
}

fn now() -> Instant {
    Instant::now()
}

#[test]
fn two_stores_then_one_removal_keep_the_block_second_removal_drops_it() {
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[42]));
    ix.store(0, 0, &keys(&[42]));
    assert_eq!(ix.remove(0, 0, &keys(&[42])), 0);
    assert!(ix.holds_key(0, BlockKey(42)));
    assert_eq!(ix.blocks(0), 1);
    assert_eq!(ix.remove(0, 0, &keys(&[42])), 1);
    assert!(!ix.holds_key(0, BlockKey(42)));
    assert_eq!(ix.blocks(0), 0);
}

#[test]
fn score_is_the_leading_run_not_the_intersection() {
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[1, 2, 3]));
    ix.store(1, 0, &keys(&[1, 3, 4, 5]));
    ix.store(2, 0, &keys(&[2, 3, 4]));
    assert_eq!(
        ix.score(&keys(&[1, 2, 3, 4, 5]), now()),
        vec![(0, 3), (1, 1)]
    );
}

#[test]
fn a_block_held_by_several_endpoints_scores_for_each_and_survives_one_leaving() {
    let ix = KvIndex::new(1000);
    for ep in 0..4 {
        ix.store(ep, 0, &keys(&[7, 8]));
    }
    ix.remove(2, 0, &keys(&[8]));
    assert_eq!(
        ix.score(&keys(&[7, 8]), now()),
        vec![(0, 2), (1, 2), (2, 1), (3, 2)]
    );
    ix.clear_endpoint(0);
    ix.clear_endpoint(1);
    assert_eq!(ix.score(&keys(&[7, 8]), now()), vec![(2, 1), (3, 2)]);
}

#[test]
fn ranks_are_separate_streams_and_endpoint_takes_its_best_rank() {
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[1, 2]));
    ix.store(0, 1, &keys(&[1, 2, 3]));
    assert_eq!(ix.score(&keys(&[1, 2, 3]), now()), vec![(0, 3)]);
    ix.clear_rank(0, 1);
    assert_eq!(ix.score(&keys(&[1, 2, 3]), now()), vec![(0, 2)]);
    assert_eq!(ix.blocks(0), 2);
}

#[test]
fn all_ranks_cleared_by_clear_endpoint() {
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[1]));
    ix.store(0, 3, &keys(&[2]));
    ix.store(1, 0, &keys(&[1]));
    ix.clear_endpoint(0);
    assert_eq!(ix.blocks(0), 0);
    assert_eq!(ix.score(&keys(&[1]), now()), vec![(1, 1)]);
}

#[test]
fn cap_evicts_oldest_blocks_first_and_counts_them() {
    let ix = KvIndex::new(3);
    let out = ix.store(0, 0, &keys(&[1, 2, 3, 4, 5]));
    assert_eq!(
        out,
        StoreOutcome {
            added: 5,
            evicted: 2
        }
    );
    assert_eq!(ix.evictions(), 2);
    assert_eq!(ix.keys_of(0), keys(&[3, 4, 5]));
    assert!(!ix.holds_key(0, BlockKey(1)));
}

#[test]
fn cap_skips_keys_already_removed() {
    let ix = KvIndex::new(2);
    ix.store(0, 0, &keys(&[1, 2]));
    ix.remove(0, 0, &keys(&[1]));
    let out = ix.store(0, 0, &keys(&[3]));
    assert_eq!(out.evicted, 0);
    let out = ix.store(0, 0, &keys(&[4]));
    assert_eq!(out.evicted, 1);
    assert_eq!(ix.keys_of(0), keys(&[3, 4]));
}

#[test]
fn fifo_is_compacted_under_store_remove_churn() {
    let ix = KvIndex::new(1_000_000);
    for i in 0..5000u64 {
        ix.store(0, 0, &keys(&[i]));
        ix.remove(0, 0, &keys(&[i]));
    }
    ix.store(0, 0, &keys(&[99_999]));
    assert_eq!(ix.keys_of(0), keys(&[99_999]));
    let fifo_len = ix
        .slots
        .lock()
        .get(&slot(0, 0))
        .map(|s| s.fifo.len())
        .unwrap_or(0);
    assert!(fifo_len <= 1024 + 3, "fifo kept {fifo_len} stale entries");
}

#[tokio::test(start_paused = true)]
async fn predicted_blocks_score_until_their_ttl_expires() {
    let ix = KvIndex::new(1000);
    let ttl = Duration::from_secs(5);
    ix.predict(1, &keys(&[10, 11]), Instant::now() + ttl);
    assert_eq!(ix.score(&keys(&[10, 11, 12]), Instant::now()), vec![(1, 2)]);
    tokio::time::advance(Duration::from_millis(4999)).await;
    assert_eq!(ix.score(&keys(&[10, 11]), Instant::now()), vec![(1, 2)]);
    tokio::time::advance(Duration::from_millis(2)).await;
    assert_eq!(ix.score(&keys(&[10, 11]), Instant::now()), vec![]);
    ix.sweep_predicted(Instant::now());
    assert_eq!(ix.predicted_len(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_confirming_event_makes_a_predicted_block_real() {
    let ix = KvIndex::new(1000);
    ix.predict(1, &keys(&[10, 11]), Instant::now() + Duration::from_secs(5));
    ix.store(1, 0, &keys(&[10]));
    tokio::time::advance(Duration::from_secs(6)).await;
    assert_eq!(ix.score(&keys(&[10, 11]), Instant::now()), vec![(1, 1)]);
    assert_eq!(ix.blocks(1), 1);
}

#[test]
fn empty_request_scores_nothing() {
    let ix = KvIndex::new(10);
    ix.store(0, 0, &keys(&[1]));
    assert!(ix.score(&[], now()).is_empty());
}

#[tokio::test(start_paused = true)]
async fn sweep_frees_expired_predictions_and_keeps_live_ones() {
    let ix = KvIndex::new(1000);
    let live = |ix: &KvIndex| ix.predicted_len();
    ix.predict(0, &keys(&[1]), Instant::now() + Duration::from_millis(100));
    ix.predict(1, &keys(&[2]), Instant::now() + Duration::from_millis(300));
    tokio::time::advance(Duration::from_millis(200)).await;
    ix.sweep_predicted(Instant::now());
    assert_eq!(live(&ix), 1, "block 2's prediction has not expired");
    assert_eq!(ix.score(&keys(&[2]), Instant::now()), vec![(1, 1)]);
    tokio::time::advance(Duration::from_millis(200)).await;
    ix.sweep_predicted(Instant::now());
    assert_eq!(live(&ix), 0);
}

#[tokio::test]
async fn a_prediction_continues_the_endpoints_confirmed_prefix() {
    // ep0 holds blocks 1, 2; a request for 1..=5 was just routed to it, so 3, 4, 5 are
    // predicted there (predict skips the two it holds). Its cached run is then all 5 blocks.
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[1, 2]));
    ix.store(1, 0, &keys(&[1, 2, 3]));
    let until = Instant::now() + Duration::from_secs(5);
    ix.predict(0, &keys(&[1, 2, 3, 4, 5]), until);
    assert_eq!(
        ix.score(&keys(&[1, 2, 3, 4, 5, 6]), now()),
        vec![(0, 5), (1, 3)]
    );
    // The other way round: predicted head, confirmed tail (rank 2) on ep2.
    ix.predict(2, &keys(&[7, 8]), until);
    ix.store(2, 2, &keys(&[9]));
    assert_eq!(ix.score(&keys(&[7, 8, 9, 10]), now()), vec![(2, 3)]);
    // Another endpoint's prediction never extends ep1's run, and a gap ends it.
    ix.predict(3, &keys(&[4]), until);
    assert_eq!(ix.score(&keys(&[1, 2, 3, 4]), now())[1], (1, 3));
    assert_eq!(ix.score(&keys(&[1, 2, 6, 4]), now()), vec![(0, 2), (1, 2)]);
}

#[tokio::test]
async fn an_engine_reset_keeps_predictions_of_requests_routed_since() {
    // The engine's AllBlocksCleared arrives with its next step, after the gateway already
    // routed (and predicted) a new request there: the prediction must survive the clear.
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[1, 2]));
    ix.predict(0, &keys(&[5, 6]), Instant::now() + Duration::from_secs(5));
    ix.clear_endpoint(0);
    assert_eq!(ix.blocks(0), 0);
    assert_eq!(ix.score(&keys(&[1, 2]), now()), vec![]);
    assert_eq!(ix.score(&keys(&[5, 6]), now()), vec![(0, 2)]);
}

/// Brute-force score of one endpoint: the longest leading run over its streams, where a
/// confirmed stream continues through blocks it holds or its endpoint is predicted on, and the
/// predicted stream through blocks its endpoint is predicted on or any of its ranks holds.
fn model_score(
    held: &HashMap<(Member, u32), HashMap<u64, u32>>,
    predicted: &HashMap<Member, std::collections::HashSet<u64>>,
    ep: Member,
    request: &[u64],
) -> usize {
    let pred = |k: &u64| predicted.get(&ep).is_some_and(|p| p.contains(k));
    let any_rank =
        |k: &u64| (0..=MAX_RANK).any(|r| held.get(&(ep, r)).is_some_and(|h| h.contains_key(k)));
    let mut best = 0;
    for r in 0..=MAX_RANK {
        if let Some(h) = held.get(&(ep, r)) {
            let run = request
                .iter()
                .take_while(|k| h.contains_key(k) || pred(k))
                .count();
            if h.contains_key(&request[0]) {
                best = best.max(run);
            }
        }
    }
    if pred(&request[0]) {
        best = best.max(
            request
                .iter()
                .take_while(|k| pred(k) || any_rank(k))
                .count(),
        );
    }
    best
}

/// A xorshift64 generator from `seed`: each call returns the next value modulo `n`.
fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    }
}

#[test]
fn scores_with_a_reused_scratch_equal_a_brute_force_model_under_random_churn() {
    // Few keys and endpoints so that consecutive request blocks often have identical holder
    // lists (the skip path) and often differ in order or membership (the full pass).
    let mut rnd = xorshift(0x2545_F491_4F6C_DD1D);
    let ix = KvIndex::new(1_000_000);
    // Per stream, key → references (the index counts a key stored twice as two copies).
    let mut held: HashMap<(Member, u32), HashMap<u64, u32>> = HashMap::new();
    let mut predicted: HashMap<Member, std::collections::HashSet<u64>> = HashMap::new();
    let later = now() + Duration::from_secs(3600);
    let mut scratch = ScoreScratch::default();
    for step in 0..3000 {
        let (ep, rank) = (rnd(6) as Member, rnd(2) as u32);
        let from = rnd(12);
        let run: Vec<u64> = (from..from + 1 + rnd(8)).collect();
        match rnd(10) {
            0..=4 => {
                ix.store(ep, rank, &keys(&run));
                let h = held.entry((ep, rank)).or_default();
                run.iter().for_each(|&k| *h.entry(k).or_default() += 1);
                if let Some(p) = predicted.get_mut(&ep) {
                    run.iter().for_each(|k| {
                        p.remove(k);
                    });
                }
            }
            5..=7 => {
                ix.remove(ep, rank, &keys(&run));
                if let Some(h) = held.get_mut(&(ep, rank)) {
                    for k in &run {
                        if let Some(n) = h.get_mut(k) {
                            *n -= 1;
                            if *n == 0 {
                                h.remove(k);
                            }
                        }
                    }
                }
            }
            8 => {
                let fresh: Vec<u64> = run
                    .iter()
                    .copied()
                    .filter(|k| {
                        !(0..=MAX_RANK)
                            .any(|r| held.get(&(ep, r)).is_some_and(|h| h.contains_key(k)))
                    })
                    .collect();
                ix.predict(ep, &keys(&fresh), later);
                predicted.entry(ep).or_default().extend(fresh);
            }
            _ => {
                ix.clear_endpoint(ep);
                for r in 0..=MAX_RANK {
                    held.remove(&(ep, r));
                }
            }
        }
        let from = rnd(12);
        let request: Vec<u64> = (from..from + 1 + rnd(10)).collect();
        let want: Vec<(Member, usize)> = (0..6)
            .map(|e| (e, model_score(&held, &predicted, e, &request)))
            .filter(|&(_, n)| n > 0)
            .collect();
        assert_eq!(
            ix.score_with(&keys(&request), now(), &mut scratch),
            want.as_slice(),
            "step {step}, request {request:?}"
        );
        assert_eq!(
            ix.held_or_predicted(BlockKey(request[0]), now()),
            !want.is_empty(),
            "step {step}, first block {}",
            request[0]
        );
    }
}

#[test]
fn held_or_predicted_counts_gpu_holders_and_live_predictions_not_offload_copies() {
    let ix = KvIndex::new(1000);
    let t0 = now();
    assert!(!ix.held_or_predicted(BlockKey(1), t0), "empty index");
    ix.store_in(3, 0, Tier::Offload, &keys(&[1]));
    assert!(
        !ix.held_or_predicted(BlockKey(1), t0),
        "an offload copy alone scores nothing"
    );
    assert!(ix.score(&keys(&[1]), t0).is_empty());
    ix.predict(2, &keys(&[1]), t0 + Duration::from_secs(5));
    assert!(ix.held_or_predicted(BlockKey(1), t0), "a live prediction");
    assert!(
        !ix.held_or_predicted(BlockKey(1), t0 + Duration::from_secs(5)),
        "a prediction expired at now"
    );
    ix.store(4, 1, &keys(&[1]));
    assert!(ix.held_or_predicted(BlockKey(1), t0 + Duration::from_secs(9)));
    assert!(!ix.held_or_predicted(BlockKey(2), t0), "another key");
    ix.predict(5, &keys(&[2]), t0 + Duration::from_secs(5));
    assert!(
        ix.held_or_predicted(BlockKey(2), t0),
        "a prediction of a key no stream holds"
    );
}

/// Checks every position's holders against `want` (key → sorted slots) and every interned
/// set's use count against the positions using it.
fn assert_holders(ix: &KvIndex, want: &HashMap<u64, Vec<u32>>, ctx: &str) {
    let t = ix.table.read();
    for (&k, slots) in want {
        assert_eq!(
            t.holders(t.word(k)).slots(),
            slots.as_slice(),
            "{ctx}: key {k}"
        );
    }
    let mut uses: HashMap<u32, u32> = HashMap::new();
    for ch in &t.chains {
        for &w in &ch.words {
            if w != EMPTY && w & MULTI != 0 {
                *uses.entry(w & LOW).or_default() += 1;
            }
        }
    }
    for (id, rec) in t.sets.iter().enumerate() {
        let id = id as u32;
        if t.free_sets.contains(&id) {
            assert!(!uses.contains_key(&id), "{ctx}: freed set {id} in use");
        } else {
            assert_eq!(
                rec.uses,
                uses.get(&id).copied().unwrap_or(0),
                "{ctx}: uses of set {id}"
            );
        }
    }
}

#[test]
fn memoized_set_transitions_stay_exact_with_interleaved_stores_and_removes() {
    // Runs of blocks stored and removed by interleaved endpoints: consecutive blocks repeat
    // the previous block's transition (the memo), and removes in between free sets whose ids
    // the next interned sets reuse.
    let mut rnd = xorshift(0x9E37_79B9_7F4A_7C15);
    let ix = KvIndex::new(1_000_000);
    let mut want: HashMap<u64, Vec<u32>> = HashMap::new();
    for step in 0..4000 {
        let (ep, rank) = (rnd(5) as Member, rnd(2) as u32);
        let s = slot(ep, rank);
        let from = rnd(24);
        let mut run: Vec<u64> = (from..from + 1 + rnd(16)).collect();
        if rnd(4) == 0 {
            run.reverse();
        }
        if rnd(5) < 3 {
            ix.store(ep, rank, &keys(&run));
            for k in &run {
                let h = want.entry(*k).or_default();
                if let Err(at) = h.binary_search(&s) {
                    h.insert(at, s);
                }
            }
        } else {
            // Every reference: a run stored twice needs two removes, so clear the stream's
            // keys one by one until the slot lost each.
            for k in &run {
                while ix.table.read().holds(*k, s) {
                    ix.remove(ep, rank, &keys(&[*k]));
                }
                if let Some(h) = want.get_mut(k) {
                    h.retain(|&x| x != s);
                }
            }
        }
        assert_holders(&ix, &want, &format!("step {step}"));
    }
}

#[test]
fn a_live_prediction_after_holder_set_changes_keeps_the_runs_recorded_before_it() {
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[1, 2, 3, 4]));
    ix.store(1, 0, &keys(&[1, 2]));
    ix.store(1, 1, &keys(&[1]));
    ix.store(2, 0, &keys(&[1, 2, 3]));
    ix.store(3, 0, &keys(&[1]));
    ix.predict(2, &keys(&[4]), now() + Duration::from_secs(60));
    let mut scratch = ScoreScratch::default();
    let want = vec![(0, 4), (1, 2), (2, 4), (3, 1)];
    for _ in 0..3 {
        assert_eq!(
            ix.score_with(&keys(&[1, 2, 3, 4, 5]), now(), &mut scratch),
            want.as_slice()
        );
        assert_eq!(
            ix.score_with(&keys(&[1, 2, 3]), now(), &mut scratch),
            &[(0, 3), (1, 2), (2, 3), (3, 1)]
        );
    }
}

#[test]
fn survival_tags_restart_when_they_would_wrap() {
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[1, 2, 3]));
    ix.store(1, 0, &keys(&[1, 2]));
    ix.store(2, 0, &keys(&[1]));
    let mut scratch = ScoreScratch::default();
    let want = [(0, 3), (1, 2), (2, 1)];
    assert_eq!(ix.score_with(&keys(&[1, 2, 3]), now(), &mut scratch), &want);
    for base in [u32::MAX - 7, u32::MAX - 4, u32::MAX - 3, u32::MAX] {
        scratch.base = base;
        assert_eq!(ix.score_with(&keys(&[1, 2, 3]), now(), &mut scratch), &want);
        assert_eq!(ix.score_with(&keys(&[1, 2, 3]), now(), &mut scratch), &want);
    }
}

#[test]
fn survivors_find_their_endpoint_entry_when_ranks_share_it_and_offload_copies_are_skipped() {
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[1, 2, 3]));
    ix.store(0, 1, &keys(&[1, 2]));
    ix.store_in(1, 0, Tier::Offload, &keys(&[1, 2, 3, 4]));
    ix.store(1, 0, &keys(&[1]));
    ix.store(2, 0, &keys(&[1, 2, 3, 4]));
    ix.store(3, 2, &keys(&[1, 2, 3]));
    let mut scratch = ScoreScratch::default();
    for _ in 0..2 {
        assert_eq!(
            ix.score_with(&keys(&[1, 2, 3, 4]), now(), &mut scratch),
            &[(0, 3), (1, 1), (2, 4), (3, 3)]
        );
        assert_eq!(
            ix.score_with(&keys(&[1, 2]), now(), &mut scratch),
            &[(0, 2), (1, 1), (2, 2), (3, 2)]
        );
    }
}

/// A block on the GPU and in the offload tier, or on two ranks, is listed once (the inventory
/// lists `keys_of`); each tier's copy still counts in `blocks` (the gauge).
#[test]
fn a_block_on_both_tiers_and_two_ranks_is_listed_once() {
    let ix = KvIndex::new(1000);
    ix.store(0, 0, &keys(&[1, 2, 3]));
    ix.store_in(0, 0, Tier::Offload, &keys(&[2, 3, 4]));
    ix.store(0, 1, &keys(&[3, 5]));
    assert_eq!(ix.keys_of(0), keys(&[1, 2, 3, 4, 5]));
    assert_eq!(ix.blocks(0), 8);
}
