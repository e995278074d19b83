use super::*;

fn c(ep: EpIdx, overlap: usize, load: u64) -> Cand {
    Cand {
        ep,
        overlap,
        load,
        work: 0,
        weight: 1,
    }
}

fn params(mode: LbMode, relief: bool) -> LawParams {
    LawParams {
        mode,
        mean_load_factor: 175,
        load_penalty: 32,
        spill_relief: relief,
        cap_sum_milli: 0,
        request_blocks: 4,
        block_size: 16,
        unit: 1,
        copy_percent: 100,
        request_tokens: 32,
        batch_slots: 0,
        spill_floor: 0,
        work_guard_percent: 0,
    }
}

fn pick(ep: EpIdx, spilled: bool) -> Option<Pick> {
    Some(Pick { ep, spilled })
}

#[test]
fn off_is_argmax_with_ties_to_lower_load_then_index() {
    // Load only breaks the tie between ep1 and ep2; it never outweighs overlap.
    let cands = [c(0, 2, 0), c(1, 3, 100), c(2, 3, 0), c(3, 3, 0)];
    assert_eq!(blend(&cands, &params(LbMode::Off, true)), pick(2, false));
    let cands = [c(0, 2, 0), c(1, 3, 100), c(2, 3, 101)];
    assert_eq!(blend(&cands, &params(LbMode::Off, true)), pick(1, false));
}

#[test]
fn shared_prefix_held_everywhere_goes_to_the_least_loaded_endpoint() {
    // A system prompt every endpoint caches (o = 4 everywhere): LoxiLB's index-order tie-break
    // would send all of it to ep0; loxi spreads it by load, under every law but `soft`.
    let cands = [c(0, 4, 3), c(1, 4, 2), c(2, 4, 1), c(3, 4, 2)];
    for mode in [LbMode::Off, LbMode::Hard, LbMode::Adaptive, LbMode::Work] {
        assert_eq!(
            blend(&cands, &params(mode, true)),
            pick(2, false),
            "{mode:?}"
        );
    }
    assert_eq!(owner(&cands), Some(2));
}

#[test]
fn hard_walk_breaks_overlap_ties_by_load() {
    // T = 12, cap = ceil(1.75 · 13 / 3) = 8: the owner ep0 (o = 4, L = 8) is over cap; ep1 and
    // ep2 tie on o = 2, ep2 is less loaded and wins (LoxiLB's order would pick ep1).
    let cands = [c(0, 4, 8), c(1, 2, 3), c(2, 2, 1)];
    assert_eq!(blend(&cands, &params(LbMode::Hard, false)), pick(2, true));
}

#[test]
fn hard_cap_formula_exact_values() {
    // T = 5, c = 1/3, ε = 0.75: ceil(1.75 · 6 / 3) = ceil(3.5) = 4.
    let cands = [c(0, 4, 5), c(1, 2, 0), c(2, 0, 0)];
    assert_eq!(cap(&cands[0], &cands, 0.75), 4);
    // weight 3 of 4: ceil(1.75 · 6 · 0.75) = ceil(7.875) = 8.
    let weighted = [
        Cand {
            weight: 3,
            ..c(0, 4, 5)
        },
        c(1, 0, 0),
    ];
    assert_eq!(cap(&weighted[0], &weighted, 0.75), 8);
}

#[test]
fn hard_keeps_owner_under_cap() {
    // T = 1: cap = ceil(1.75 · 2 / 3) = 2 and L0 + 1 = 2 ≤ 2.
    let cands = [c(0, 4, 1), c(1, 2, 0), c(2, 0, 0)];
    assert_eq!(blend(&cands, &params(LbMode::Hard, false)), pick(0, false));
}

#[test]
fn hard_spills_over_cap_owner_to_next_overlap_holder() {
    // cap 4, owner at 5 + 1 = 6 > 4; ep1 (overlap 2) has 1 ≤ 4.
    let cands = [c(0, 4, 5), c(1, 2, 0), c(2, 0, 0)];
    assert_eq!(blend(&cands, &params(LbMode::Hard, false)), pick(1, true));
}

#[test]
fn hard_spill_relief_goes_to_least_loaded_under_cap_even_without_overlap() {
    // T = 11: cap = ceil(1.75 · 12 / 3) = 7, relief cap = ceil(2.5 · 12 / 3) = 10; owner
    // 10 + 1 > 10 → relief to ep2, the least loaded (0).
    let cands = [c(0, 4, 10), c(1, 0, 1), c(2, 0, 0)];
    assert_eq!(blend(&cands, &params(LbMode::Hard, true)), pick(2, true));
    assert_eq!(blend(&cands, &params(LbMode::Hard, false)), pick(0, false));
}

#[test]
fn hard_relief_waits_for_twice_the_slack() {
    // T = 10: cap = ceil(1.75 · 11 / 3) = 7, relief cap = ceil(2.5 · 11 / 3) = 10: the owner
    // at 9 is over the cap but 9 + 1 ≤ 10, so it keeps the request (LoxiLB would relieve to
    // ep2 and recompute the prefix there); one more in flight and relief starts (test above).
    let cands = [c(0, 4, 9), c(1, 0, 1), c(2, 0, 0)];
    assert_eq!(blend(&cands, &params(LbMode::Hard, true)), pick(0, false));
    // A holder under the plain cap still takes the spill before relief is considered.
    let cands = [c(0, 4, 9), c(1, 1, 1), c(2, 0, 0)];
    assert_eq!(blend(&cands, &params(LbMode::Hard, true)), pick(1, true));
}

#[test]
fn hard_relief_counts_every_holder_of_the_prefix() {
    // A cold burst of one prefix held by ep0 and ep1 (a cold seed made the second copy),
    // T = 40 over 4: cap = ceil(1.75 · 41 / 4) = 18, relief cap = ceil(2.5 · 41 / 4) = 26.
    // Neither holder is over the relief cap alone (20 + 1 ≤ 26), but together they carry 40:
    // relief to the least loaded under-cap endpoint (ep2), as LoxiLB's bound asks.
    let cands = [c(0, 4, 20), c(1, 4, 20), c(2, 0, 0), c(3, 0, 0)];
    assert!(relief_due(&cands, &cands[0], 0.75));
    assert_eq!(blend(&cands, &params(LbMode::Hard, true)), pick(2, true));
    // Without spill relief, LoxiLB's law keeps the owner (lower load, then index).
    assert_eq!(blend(&cands, &params(LbMode::Hard, false)), pick(0, false));
    // One holder: the sum is the owner's load, the rule of `hard_relief_waits_for_twice_the_slack`.
    let one = [c(0, 4, 9), c(1, 0, 1), c(2, 0, 0)];
    assert!(!relief_due(&one, &one[0], 0.75));
    // Two holders that together stay under one relief cap keep the prefix: T = 10 over 3,
    // cap = 7, relief cap = 10; holders 4 + 4 = 8 < 10 → the walk's first under-cap holder.
    let two = [c(0, 4, 4), c(1, 4, 4), c(2, 0, 2)];
    assert!(!relief_due(&two, &two[0], 0.75));
    assert_eq!(blend(&two, &params(LbMode::Hard, true)), pick(0, false));
}

/// 64 requests of one prefix, none finishing, over 4 endpoints under `p`: the first on ep0,
/// the second a cold seed on ep1, every later one where the law says, its blocks becoming a
/// holding there (the tier's prediction). Requests per endpoint.
fn cold_burst(p: &LawParams) -> [u64; 4] {
    let mut loads = [1u64, 1, 0, 0];
    let mut held = [true, true, false, false];
    for _ in 2..64 {
        let cands: Vec<Cand> = (0..4)
            .map(|e| c(e, if held[e] { 4 } else { 0 }, loads[e]))
            .collect();
        let ep = blend(&cands, p).expect("pick").ep;
        loads[ep] += 1;
        held[ep] = true;
    }
    loads
}

#[test]
fn hard_cold_burst_of_one_prefix_stays_within_the_cap() {
    // 64 requests of one prefix, none finishing, over 4 endpoints: the first lands on ep0
    // (tier miss → rr), the second is a cold seed on ep1; every later one goes where the law
    // says and its blocks become a holding there (the tier's prediction). No endpoint may end
    // above LoxiLB's cap for the burst, ceil(1.75 · 64 / 4) = 28.
    let loads = cold_burst(&params(LbMode::Hard, true));
    assert_eq!(loads.iter().sum::<u64>(), 64);
    assert!(loads.iter().all(|&l| l <= 28), "{loads:?}");
    assert_eq!(loads, [22, 21, 21, 0]);
}

/// `hard` with the spill floor `f` for a request of `n` blocks of 16 tokens.
fn floor_params(n: usize, f: u64) -> LawParams {
    LawParams {
        request_blocks: n,
        spill_floor: f,
        ..params(LbMode::Hard, true)
    }
}

#[test]
fn spill_floor_keeps_a_lightly_loaded_owner_whose_queue_is_shorter_than_the_copy() {
    // The demo's first spill (issue 13): a 200-block request, the owner holds 192 blocks and
    // carries 2 decoding requests (no queued prefill), every other endpoint idle. T = 2,
    // cap = ceil(1.75 · 3 / 4) = 2, relief cap = ceil(2.5 · 3 / 4) = 2: LoxiLB's law
    // recomputes 3,200 tokens on ep1 instead of 128 on the owner.
    let cands = [c(0, 192, 2), c(1, 0, 0), c(2, 0, 0), c(3, 0, 0)];
    assert_eq!(blend(&cands, &floor_params(200, 0)), pick(1, true));
    assert_eq!(blend(&cands, &floor_params(200, 8)), pick(0, false));
    // A partial holder under the cap (the walk's branch): 41 blocks on ep1 still leave
    // 159 · 16 = 2,544 tokens to prefill there against 384 of queue + prefill on the owner.
    let cands = [
        Cand {
            work: 256,
            ..c(0, 192, 4)
        },
        c(1, 41, 1),
        c(2, 0, 1),
        c(3, 0, 2),
    ];
    assert_eq!(blend(&cands, &floor_params(200, 0)), pick(1, true));
    assert_eq!(blend(&cands, &floor_params(200, 8)), pick(0, false));
}

#[test]
fn spill_floor_lets_the_law_spill_at_f_requests_or_when_the_wait_pays_for_the_copy() {
    // At F requests on the owner, LoxiLB's law applies again (F = 8: 8 ≥ 8).
    let at_floor = [c(0, 192, 8), c(1, 0, 0), c(2, 0, 0), c(3, 0, 0)];
    assert_eq!(blend(&at_floor, &floor_params(200, 8)), pick(1, true));
    assert_eq!(blend(&at_floor, &floor_params(200, 9)), pick(0, false));
    // Below it, when the owner's queued prefill plus this request's reaches the copy's cost:
    // owner 3,072 + 8 · 16 = 3,200 ≥ 200 · 16 = 3,200 on ep1 → the law's relief stands.
    let owner = |work| Cand {
        work,
        ..c(0, 192, 3)
    };
    let pays = [owner(3_072), c(1, 0, 0), c(2, 0, 0), c(3, 0, 0)];
    assert!(spill_pays(&pays[0], &pays[1], &floor_params(200, 8)));
    assert_eq!(blend(&pays, &floor_params(200, 8)), pick(1, true));
    let short = [owner(3_071), c(1, 0, 0), c(2, 0, 0), c(3, 0, 0)];
    assert!(!spill_pays(&short[0], &short[1], &floor_params(200, 8)));
    assert_eq!(blend(&short, &floor_params(200, 8)), pick(0, false));
    // The target's own queue counts against it.
    let busy_target = [
        owner(3_072),
        Cand {
            work: 1,
            ..c(1, 0, 0)
        },
    ];
    assert!(!spill_pays(
        &busy_target[0],
        &busy_target[1],
        &floor_params(200, 8)
    ));
}

#[test]
fn spill_floor_keeps_a_cold_burst_of_one_prefix_within_the_cap() {
    // `hard_cold_burst_of_one_prefix_stays_within_the_cap` with the default floor (8): the
    // bound of LoxiLB's law holds once the owner carries F requests.
    let loads = cold_burst(&LawParams {
        spill_floor: 8,
        ..params(LbMode::Hard, true)
    });
    assert_eq!(loads.iter().sum::<u64>(), 64);
    assert!(loads.iter().all(|&l| l <= 28), "{loads:?}");
    assert_eq!(loads, [22, 21, 21, 0]);
}

#[test]
fn hard_weight_share_raises_the_cap() {
    let cands = [
        Cand {
            weight: 3,
            ..c(0, 4, 5)
        },
        c(1, 0, 0),
    ];
    assert_eq!(blend(&cands, &params(LbMode::Hard, true)), pick(0, false));
}

#[test]
fn soft_utility_exact_break_even() {
    // n = 4, N·c = 1: u0 = 1000 − 32·L0, u1 = 0.
    let keep = [c(0, 4, 31), c(1, 0, 0)];
    assert_eq!(blend(&keep, &params(LbMode::Soft, false)), pick(0, false));
    let spill = [c(0, 4, 32), c(1, 0, 0)];
    assert_eq!(blend(&spill, &params(LbMode::Soft, false)), pick(1, true));
}

#[test]
fn fleet_factor_is_mean_load_or_capacity_normalised_and_clamped() {
    let cands = [c(0, 4, 16), c(1, 0, 4), c(2, 0, 4)];
    assert_eq!(fleet_factor(&cands, 0), 8.0);
    assert_eq!(fleet_factor(&cands, 4000), 6.0);
    assert_eq!(fleet_factor(&[c(0, 1, 0)], 0), 0.125);
}

#[test]
fn adaptive_lets_owner_carry_more_when_fleet_is_busy() {
    // T = 36: cap = ceil(1.75 · 37 / 3) = 22, relief cap = ceil(2.5 · 37 / 3) = 31 ≤ 32 →
    // relief to ep1 (least loaded, ties by index).
    // adaptive: f = 8, ε = 6, cap = ceil(7 · 37 / 3) = 87 → owner keeps it.
    let cands = [c(0, 4, 32), c(1, 0, 2), c(2, 0, 2)];
    assert_eq!(blend(&cands, &params(LbMode::Hard, true)), pick(1, true));
    assert_eq!(
        blend(&cands, &params(LbMode::Adaptive, true)),
        pick(0, false)
    );
}

#[test]
fn adaptive_soft_prices_load_higher_when_fleet_is_busy() {
    // soft λ = 32: u0 = 1000 − 512 = 488, u1 = −128 → owner.
    // adaptive-soft λ = 256: u0 = 1000 − 4096 = −3096, u1 = −1024 → ep1.
    let cands = [c(0, 4, 16), c(1, 0, 4), c(2, 0, 4)];
    assert_eq!(blend(&cands, &params(LbMode::Soft, false)), pick(0, false));
    assert_eq!(
        blend(&cands, &params(LbMode::AdaptiveSoft, false)),
        pick(1, true)
    );
}

#[test]
fn mode_names_parse_and_garbage_is_none() {
    assert_eq!(LbMode::parse("adaptive-soft"), Some(LbMode::AdaptiveSoft));
    assert_eq!(LbMode::parse(" HARD "), Some(LbMode::Hard));
    assert_eq!(LbMode::parse("bogus"), None);
}

/// `work` law parameters for a request of `n` blocks of 16 tokens (ξ = 1, κ = 32).
fn work_params(n: usize, slots: u64) -> LawParams {
    LawParams {
        request_blocks: n,
        batch_slots: slots,
        ..params(LbMode::Work, true)
    }
}

fn w(ep: EpIdx, overlap: usize, load: u64, work: u64) -> Cand {
    Cand {
        work,
        ..c(ep, overlap, load)
    }
}

#[test]
fn work_keeps_a_burst_on_its_holder_while_its_queue_is_shorter_than_the_saving() {
    // n = 200 blocks (3200 tokens); ep0 holds 192 (3072 tokens) and is prefilling the burst's
    // first request (W0 = 3200, L0 = 1): cost0 = 3200 + 8·16 + 32·1 = 3360; an idle ep1 pays
    // the whole prompt plus the copy: 3200 + 3072 = 6272. The holder keeps it (`hard` at
    // T = 1 has cap 2 and would too; at T = 2 with 2 on the owner it spills).
    let p = work_params(200, 0);
    let cands = [w(0, 192, 1, 3200), w(1, 0, 0, 0), w(2, 0, 0, 0)];
    assert_eq!(work_cost(&cands[0], &cands, &p), 3360.0);
    assert_eq!(work_cost(&cands[1], &cands, &p), 6272.0);
    assert_eq!(blend(&cands, &p), pick(0, false));
    // 16 requests of the group in flight there, one still prefilling: 3200 + 15·128 queued is
    // less than the saving, so no spill where `hard` (relief cap ceil(2.5·17/3) = 15) sends it
    // to an idle endpoint to recompute the prefix.
    let cands = [w(0, 192, 16, 3200 + 15 * 128), w(1, 0, 0, 0), w(2, 0, 0, 0)];
    assert_eq!(blend(&cands, &p), pick(0, false));
    assert_eq!(blend(&cands, &params(LbMode::Hard, true)), pick(1, true));
}

#[test]
fn work_spills_once_the_holders_queue_costs_more_than_the_saving() {
    // W0 = 6200, L0 = 10: cost0 = 6200 + 128 + 320 = 6648 > 6272 = cost1 = cost2; the tie
    // between the two idle endpoints goes to the lower index.
    let p = work_params(200, 0);
    let cands = [w(0, 192, 10, 6200), w(1, 0, 0, 0), w(2, 0, 0, 0)];
    assert_eq!(work_cost(&cands[0], &cands, &p), 6648.0);
    assert_eq!(blend(&cands, &p), pick(1, true));
    // A second holder of a shorter prefix (100 blocks) is cheaper than a cold copy:
    // 0 + 100·16 + 92·16 = 3072 < 6272.
    let cands = [w(0, 192, 10, 6200), w(1, 0, 0, 0), w(2, 100, 0, 0)];
    assert_eq!(work_cost(&cands[2], &cands, &p), 3072.0);
    assert_eq!(blend(&cands, &p), pick(2, true));
}

#[test]
fn work_without_reuse_is_least_work_then_least_load() {
    // Every endpoint holds the same one block: the saving is equal everywhere, so queued work
    // decides (ep0 has 100 tokens queued), then load (ep1 has 2 in flight, ep2 1):
    // 436, 368, 336. The owner (overlap, then request count, then index) is ep0.
    let p = work_params(20, 0);
    let cands = [w(0, 1, 1, 100), w(1, 1, 2, 0), w(2, 1, 1, 0)];
    assert_eq!(work_cost(&cands[0], &cands, &p), 436.0);
    assert_eq!(blend(&cands, &p), pick(2, true));
    assert_eq!(owner(&cands), Some(0));
}

#[test]
fn work_charges_a_request_beyond_the_free_batch_slots_one_more_prefill() {
    // n = 200, the holder has 100 blocks and 4 requests in flight, nothing queued:
    // cost0 = 1600 + 128 = 1728, cost1 = 3200 + 1600 = 4800. With S = 4 slots the fifth
    // request waits for one: cost0 = 1728 + 3200 = 4928 > 4800 → ep1.
    let cands = [w(0, 100, 4, 0), w(1, 0, 0, 0)];
    assert_eq!(blend(&cands, &work_params(200, 0)), pick(0, false));
    assert_eq!(blend(&cands, &work_params(200, 4)), pick(1, true));
}

#[test]
fn work_divides_by_the_capacity_share() {
    // Weight 3 of 4 on ep1 (N·c = 1.5) against 1 of 4 on ep0 (N·c = 0.5), no overlap
    // difference: cost0 = (64 + 0)/0.5 = 128, cost1 = (64 + 32·2)/1.5 ≈ 85.3 → ep1.
    let p = work_params(4, 0);
    let cands = [
        w(0, 0, 0, 0),
        Cand {
            weight: 3,
            ..w(1, 0, 2, 0)
        },
    ];
    assert_eq!(work_cost(&cands[0], &cands, &p), 128.0);
    assert_eq!(blend(&cands, &p), pick(1, true));
}

#[test]
fn work_parses_and_prints() {
    assert_eq!(LbMode::parse(" Work "), Some(LbMode::Work));
    assert_eq!(LbMode::Work.as_str(), "work");
}

#[test]
fn replica_copies_a_busy_owners_prefix_onto_an_idle_endpoint_with_room() {
    // A new conversation: ep0 holds the shared system prompt (10 blocks) and serves both
    // requests in flight; ep1 and ep2 hold nothing and are idle.
    let cands = [c(0, 10, 2), c(1, 0, 0), c(2, 0, 0)];
    let room = |_: &Cand| true;
    // T = 2: L_0 + 1 = 3 > ceil(3 / 3) = 1 and L_0 ≥ R = 2 → the lowest-index idle endpoint.
    assert_eq!(replica(&cands, 0, 2, room), Some(1));
    // ep1's cache is not empty: ep2.
    assert_eq!(replica(&cands, 0, 2, |c: &Cand| c.ep != 1), Some(2));
    // No room anywhere: no copy.
    assert_eq!(replica(&cands, 0, 2, |_: &Cand| false), None);
    // One request on the owner (< R): it keeps the request; R = 0 turns replicas off.
    assert_eq!(
        replica(&[c(0, 10, 1), c(1, 0, 0), c(2, 0, 0)], 0, 2, room),
        None
    );
    assert_eq!(replica(&cands, 0, 0, room), None);
    // R = 1: one request is enough.
    assert_eq!(
        replica(&[c(0, 10, 1), c(1, 0, 0), c(2, 0, 0)], 0, 1, room),
        Some(1)
    );
}

#[test]
fn replica_waits_for_the_pick_to_exceed_its_share_and_for_an_idle_target() {
    // ep0 holds the prefix with 2 in flight, but the others are as busy:
    // T = 6, share ceil(7 / 3) = 3, L_0 + 1 = 3 is not over it.
    let even = [c(0, 10, 2), c(1, 0, 2), c(2, 0, 2)];
    assert_eq!(replica(&even, 0, 2, |_: &Cand| true), None);
    // Over its share (T = 5, share 2, L_0 + 1 = 5), but ep1 has a request in flight and ep2
    // queued prefill work: neither is idle.
    let busy = [
        c(0, 10, 4),
        c(1, 0, 1),
        Cand {
            work: 64,
            ..c(2, 0, 0)
        },
    ];
    assert_eq!(replica(&busy, 0, 2, |_: &Cand| true), None);
    // A pick without overlap has nothing to copy; an idle endpoint holding as much is no copy.
    assert_eq!(
        replica(&[c(0, 0, 4), c(1, 0, 0)], 0, 2, |_: &Cand| true),
        None
    );
    assert_eq!(
        replica(&[c(0, 10, 4), c(1, 10, 0)], 0, 2, |_: &Cand| true),
        None
    );
    // Capacity shares: ep0 has weight 3 of 4, share ceil(5 · 3/4) = 4, L_0 + 1 = 5 > 4.
    let weighted = [
        Cand {
            weight: 3,
            ..c(0, 10, 4)
        },
        c(1, 0, 0),
    ];
    assert_eq!(replica(&weighted, 0, 2, |_: &Cand| true), Some(1));
    let weighted = [
        Cand {
            weight: 4,
            ..c(0, 10, 3)
        },
        c(1, 0, 0),
    ];
    // share ceil(4 · 4/5) = 4, L_0 + 1 = 4: not over it.
    assert_eq!(replica(&weighted, 0, 2, |_: &Cand| true), None);
}

/// `hard` (floor 8) with the work guard `g` percent, for a request of 200 blocks of 16 tokens.
fn guard_params(mode: LbMode, g: u32) -> LawParams {
    LawParams {
        mode,
        request_blocks: 200,
        spill_floor: 8,
        work_guard_percent: g,
        ..params(mode, true)
    }
}

fn worked(ep: EpIdx, overlap: usize, load: u64, work: u64) -> Cand {
    Cand {
        work,
        ..c(ep, overlap, load)
    }
}

#[test]
fn work_guard_moves_a_pick_whose_queue_outweighs_twice_its_saving() {
    // Low reuse (issue 13 goal 4): the owner holds 192 of 200 blocks behind queued cold
    // prefills. T = 4 over 4: cap = ceil(1.75 · 5 / 4) = 3, every endpoint under it, so
    // `hard` keeps the owner. Its wait is W + 8 · 16; ep1's is 200 · 16 = 3,200, plus
    // G · 192 · 16 = 6,144 for the copy: the owner's queue must pass 9,216 tokens.
    let at = |w| {
        [
            worked(0, 192, 2, w),
            worked(1, 0, 1, 0),
            worked(2, 0, 1, 3_200),
            worked(3, 0, 0, 6_400),
        ]
    };
    let p = guard_params(LbMode::Hard, 200);
    assert_eq!(blend(&at(9_216), &p), pick(0, false));
    assert_eq!(blend(&at(9_217), &p), pick(1, true));
    assert_eq!(work_guard(&at(9_217), &at(9_217)[0], &p), Some(1));
    // Off (G = 0): LoxiLB's `hard` keeps the owner whatever it has queued.
    assert_eq!(
        blend(&at(50_000), &guard_params(LbMode::Hard, 0)),
        pick(0, false)
    );
    // `adaptive` applies it too (ε·f).
    assert_eq!(
        blend(&at(9_217), &guard_params(LbMode::Adaptive, 200)),
        pick(1, true)
    );
    // G = 100 prices the saving only: 3,200 + 3,072 = 6,272.
    assert_eq!(
        blend(&at(6_144), &guard_params(LbMode::Hard, 100)),
        pick(0, false)
    );
    assert_eq!(
        blend(&at(6_145), &guard_params(LbMode::Hard, 100)),
        pick(1, true)
    );
}

#[test]
fn work_guard_prefers_a_partial_holder_and_never_breaks_the_cap() {
    let p = guard_params(LbMode::Hard, 200);
    // ep3 holds 100 blocks with 1,000 queued: 1,000 + 100 · 16 + 2 · 92 · 16 = 5,544, less
    // than ep1's 9,344, so the owner (wait 9,345 + 128) goes there.
    let cands = [
        worked(0, 192, 2, 9_345),
        worked(1, 0, 1, 0),
        worked(2, 0, 1, 3_200),
        worked(3, 100, 0, 1_000),
    ];
    assert_eq!(blend(&cands, &p), pick(3, true));
    // The target must be under its request share ceil((T + 1)·c_j), round robin's, not the
    // law's cap.
    let cands = [
        worked(0, 192, 1, 20_000),
        worked(1, 0, 1, 0),
        worked(2, 0, 1, 20_000),
    ];
    // T = 3 over 3: share = ceil(4 / 3) = 2; ep1 at 1 takes one more within it → moves there.
    assert_eq!(blend(&cands, &p), pick(1, true));
    let full = [
        worked(0, 192, 1, 20_000),
        worked(1, 0, 2, 0),
        worked(2, 0, 1, 20_000),
    ];
    // T = 4: share = ceil(5 / 3) = 2; ep1 at 2 would pass it (though under the cap,
    // ceil(1.75 · 5 / 3) = 3), and ep2's queue is no better.
    assert_eq!(blend(&full, &p), pick(0, false));
}

#[test]
fn work_guard_leaves_a_new_conversation_on_a_holder_within_its_share() {
    // 3 real vLLM engines, 6 users × 4 rounds (issue 13 goal 1): the 5th user's first turn
    // shares the 10-block system prompt with every endpoint; ep0 carries 2 requests whose
    // prefill is done, ep1 and ep2 one each, prefilling a fresh copy (384 tokens). `hard`
    // picks the least-loaded holder, ep1 (wait 384 + 2·32 = 448). ep0 waits only 64, but it
    // is at its share (ceil(5 / 3) = 2): the guard does not move the conversation there.
    let cands = [
        worked(0, 10, 2, 0),
        worked(1, 10, 1, 384),
        worked(2, 10, 1, 384),
    ];
    let mut p = guard_params(LbMode::Hard, 200);
    p.block_size = 32;
    p.request_blocks = 12;
    assert_eq!(blend(&cands, &p), pick(1, false));
    assert_eq!(work_guard(&cands, &cands[1], &p), None);
}
