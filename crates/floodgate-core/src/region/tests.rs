//! The region state and sync engine, region by region, by hand.

use std::time::Duration;

use super::*;
use crate::{Algorithm, Limit};

const S: u64 = 1_000_000;

fn tables(names: &[&str]) -> Vec<GlobalTable> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let peers = names.iter().filter(|p| *p != n).map(|p| (*p).to_owned()).collect();
            GlobalTable::new(RegionConfig::new(*n, peers, 100 + i as u64)).unwrap()
        })
        .collect()
}

/// Everything `a` has for `b`, delivered and acknowledged, at `now`.
fn sync(t: &[GlobalTable], a: usize, b: usize, now: u64) {
    let p = t[a].peer_index(t[b].region()).unwrap();
    while let Some(batch) = t[a].next_batch(p, now) {
        let receipt = t[b].receive(&batch, now);
        t[a].on_ack(p, &receipt.ack, now);
        if batch.items.is_empty() && !batch.complete {
            break;
        }
    }
}

fn sync_all(t: &[GlobalTable], now: u64) {
    for _ in 0..3 {
        for a in 0..t.len() {
            for b in 0..t.len() {
                if a != b {
                    sync(t, a, b, now);
                }
            }
        }
    }
}

fn fixed(limit: u64) -> Limit {
    Limit::new(Algorithm::FixedWindow, limit, Duration::from_secs(60)).unwrap()
}

fn admitted(t: &GlobalTable, key: &str, limit: &Limit, mode: SyncMode, n: u64, now: u64) -> u64 {
    (0..n).filter(|_| t.apply(key, limit, mode, 1, now).unwrap().allowed).count() as u64
}

#[test]
fn regions_see_each_others_usage_after_a_sync() {
    let t = tables(&["a", "b"]);
    sync_all(&t, 0); // warm-up: full state both ways
    assert!(!t[0].warming() && !t[1].warming());
    let l = fixed(10);
    let e = SyncMode::Eventual;
    assert_eq!(admitted(&t[0], "k", &l, e, 6, S), 6);
    assert_eq!(admitted(&t[1], "k", &l, e, 6, S), 6, "eventual: stale views over-admit");
    sync_all(&t, S);
    assert_eq!(admitted(&t[0], "k", &l, e, 1, S), 0, "a sees 12 of 10");
    assert_eq!(admitted(&t[1], "k", &l, e, 1, S), 0);
    // The next window starts fresh everywhere.
    assert_eq!(admitted(&t[0], "k", &l, e, 10, 61 * S), 10);
}

#[test]
fn a_changed_limit_starts_this_regions_count_fresh_and_keeps_the_peers() {
    let t = tables(&["a", "b"]);
    sync_all(&t, 0);
    let e = SyncMode::Eventual;
    assert_eq!(admitted(&t[0], "k", &fixed(10), e, 6, S), 6);
    assert_eq!(admitted(&t[1], "k", &fixed(10), e, 3, S), 3);
    sync_all(&t, S);
    // a's limit goes to 20 in the same window: its own 6 are gone, b's 3
    // still count.
    assert_eq!(admitted(&t[0], "k", &fixed(20), e, 30, 2 * S), 17);
    // Only the mode changed (the limit did not): the counts stay.
    assert_eq!(admitted(&t[0], "k", &fixed(20), SyncMode::Bounded { overshoot_ppm: 500_000 }, 5, 2 * S), 0);
}

#[test]
fn duplicated_replayed_and_reordered_batches_change_nothing() {
    let t = tables(&["a", "b"]);
    sync_all(&t, 0);
    // Near the limit: every admission is sent at the next batch.
    let l = fixed(10);
    let e = SyncMode::Eventual;
    admitted(&t[0], "k", &l, e, 3, S);
    let first = t[0].next_batch(0, S).unwrap();
    admitted(&t[0], "k", &l, e, 4, S);
    let second = t[0].next_batch(0, S).unwrap();
    // Newest first, then the older one twice: b keeps the largest, 7.
    for b in [&second, &first, &first, &second] {
        t[1].receive(b, S);
    }
    assert_eq!(t[1].apply("k", &l, e, 0, S).unwrap().remaining, 3);
    assert!(t[1].stats().unchanged >= 3);
}

#[test]
fn a_bounded_region_cut_off_admits_at_most_its_slice_beyond_what_it_knew() {
    let t = tables(&["a", "b", "c"]);
    sync_all(&t, 0);
    // 600 per minute, 5%: each region's slice is 10.
    let l = fixed(600);
    let m = SyncMode::Bounded { overshoot_ppm: 50_000 };
    assert_eq!(admitted(&t[0], "k", &l, m, 100, S), 10, "no acks: the slice");
    sync_all(&t, S);
    assert_eq!(t[0].unacked("k"), 0);
    assert_eq!(admitted(&t[0], "k", &l, m, 100, 2 * S), 10, "acked: another slice");
    // Partitioned: no more acks, no more than the slice.
    assert_eq!(admitted(&t[0], "k", &l, m, 100, 3 * S), 0);
    let d = t[0].apply("k", &l, m, 11, 3 * S).unwrap();
    assert!(!d.allowed && d.retry_after.is_none(), "more than the slice: never, no retry");
}

#[test]
fn the_caps_hold_for_synchronized_bursts_across_three_regions() {
    let t = tables(&["a", "b", "c"]);
    sync_all(&t, 0);
    let l = fixed(600);
    let m = SyncMode::Bounded { overshoot_ppm: 50_000 };
    let mut total = 0;
    for round in 0..200 {
        for r in &t {
            total += admitted(r, "k", &l, m, 5, S + round);
        }
        if round % 3 == 0 {
            sync_all(&t, S + round);
        }
    }
    assert!(total <= 630, "(1 + 5%) x 600 = 630, admitted {total}");
    assert!(total >= 600, "and the limit is reached: {total}");
}

#[test]
fn a_refund_reaches_every_region_exactly_and_replays_change_nothing() {
    let t = tables(&["a", "b", "c"]);
    sync_all(&t, 0);
    let e = SyncMode::Eventual;
    for l in [fixed(10), Limit::new(Algorithm::SlidingWindow, 10, Duration::from_secs(60)).unwrap()] {
        let key = format!("k:{}", l.algorithm().kind().as_str());
        assert_eq!(admitted(&t[0], &key, &l, e, 6, S), 6);
        assert_eq!(admitted(&t[1], &key, &l, e, 4, S), 4);
        sync_all(&t, S);
        assert_eq!(admitted(&t[2], &key, &l, e, 1, S), 0, "c sees 10 of 10");
        // a gives back 5 of its 6; b's 4 are b's to give back, not a's.
        let (after, given) = t[0].give_back(&key, &l, e, 5, 2 * S).unwrap();
        assert_eq!((given, after.remaining), (5, 5));
        let (_, given) = t[0].give_back(&key, &l, e, 9, 2 * S).unwrap();
        assert_eq!(given, 1, "never more than a took");
        // A batch carrying the refund, delivered twice and out of order
        // with an older one, gives back once.
        let p = t[0].peer_index("c").unwrap();
        let batch = t[0].next_batch(p, 2 * S).unwrap();
        t[2].receive(&batch, 2 * S);
        t[2].receive(&batch, 2 * S);
        sync_all(&t, 2 * S);
        for (i, r) in t.iter().enumerate() {
            assert_eq!(r.view(&key, 2 * S), vec![(0, 4)], "region {i} counts b's 4 only");
        }
        assert_eq!(admitted(&t[2], &key, &l, e, 10, 2 * S), 6, "c admits what a gave back");
    }
}

/// Regions a and b; a takes a GCRA key's whole burst (10 a second) at 5 s,
/// and b has heard it.
fn after_a_gcra_burst() -> (Vec<GlobalTable>, Limit) {
    let t = tables(&["a", "b"]);
    sync_all(&t, 0);
    let l = Limit::new(Algorithm::Gcra { burst: None }, 10, Duration::from_secs(1)).unwrap();
    assert_eq!(admitted(&t[0], "k", &l, SyncMode::Eventual, 10, 5 * S), 10);
    sync_all(&t, 5 * S);
    (t, l)
}

#[test]
fn a_gcra_refund_moves_every_regions_bucket_back() {
    let (t, l) = after_a_gcra_burst();
    let e = SyncMode::Eventual;
    assert_eq!(admitted(&t[1], "k", &l, e, 1, 5 * S), 0);
    let (_, given) = t[0].give_back("k", &l, e, 4, 5 * S).unwrap();
    assert_eq!(given, 4);
    sync_all(&t, 5 * S);
    assert_eq!(admitted(&t[1], "k", &l, e, 10, 5 * S), 4, "b's bucket moved back by the 4 given back");
    // b gives back nothing it did not take beyond what it holds: its 4.
    let (_, given) = t[1].give_back("k", &l, e, 10, 5 * S).unwrap();
    assert_eq!(given, 4);
}

#[test]
fn late_charges_are_never_refused_and_leave_the_slice_to_admissions() {
    let t = tables(&["a", "b", "c"]);
    sync_all(&t, 0);
    // 600 per minute, 5%: each region's slice is 10.
    let l = fixed(600);
    let m = SyncMode::Bounded { overshoot_ppm: 50_000 };
    // Cut off (no acknowledgements): a late charge far beyond the slice is
    // taken, and the slice still admits its 10.
    let d = t[0].charge_late("k", &l, m, 50, S).unwrap();
    assert!(d.allowed);
    assert_eq!(admitted(&t[0], "k", &l, m, 100, S), 10);
    assert_eq!(t[0].unacked("k"), 10, "late charges are not what the slice counts");
    // Past the limit: a late charge is still taken (debt), admissions stop.
    sync_all(&t, S);
    assert!(t[0].charge_late("k", &l, m, 600, 2 * S).unwrap().allowed);
    sync_all(&t, 2 * S);
    assert_eq!(t[1].view("k", 2 * S), vec![(0, 660)]);
    assert_eq!(admitted(&t[1], "k", &l, m, 1, 2 * S), 0);
    // On a limit charged after the work every hit is late, and hits 0 is
    // the gate.
    let after = fixed(600).with_charge(crate::Charge::After).unwrap();
    assert!(t[2].apply("j", &after, m, 500, 3 * S).unwrap().allowed);
    assert!(t[2].apply("j", &after, m, 500, 3 * S).unwrap().allowed, "debt, not the slice");
    assert!(!t[2].apply("j", &after, m, 0, 3 * S).unwrap().allowed, "the gate");
}

#[test]
fn gcra_usage_arrives_as_debt() {
    let (t, l) = after_a_gcra_burst();
    let e = SyncMode::Eventual;
    assert_eq!(admitted(&t[1], "k", &l, e, 10, 5 * S), 0, "a's burst drained b's bucket");
    // 500 ms later: 5 more tokens, in both.
    assert_eq!(admitted(&t[1], "k", &l, e, 10, 5 * S + S / 2), 5);
}

#[test]
fn a_restarted_region_warms_up_within_its_slice_and_recovers_its_old_usage() {
    let mut t = tables(&["a", "b", "c"]);
    sync_all(&t, 0);
    let l = fixed(600);
    let e = SyncMode::Eventual;
    assert_eq!(admitted(&t[0], "k", &l, e, 300, S), 300);
    sync_all(&t, S);
    // a restarts with its state lost: a new incarnation.
    t[0] = GlobalTable::new(RegionConfig::new("a", vec!["b".into(), "c".into()], 999)).unwrap();
    assert!(t[0].warming());
    // It knows nothing of what the others admitted: nothing until a peer's
    // full state arrives, or the warm-up wait (1 s) has passed.
    assert_eq!(admitted(&t[0], "k", &l, e, 1_000, 2 * S), 0, "cold: no peer's state yet");
    assert_eq!(admitted(&t[0], "k", &l, e, 1_000, 3 * S), 200, "its share (600 / 3) while warming");
    sync_all(&t, 3 * S);
    assert!(!t[0].warming(), "every peer sent its full state");
    // It knows its old usage (300, from its peers) and its new (200).
    assert_eq!(t[0].apply("k", &l, e, 0, 3 * S).unwrap().remaining, 100);
    assert_eq!(admitted(&t[1], "k", &l, e, 1_000, 3 * S), 100, "b sees both incarnations");
}

/// Sync every pair of `t` but those in `cut` (either way).
fn sync_but(t: &[GlobalTable], cut: &[(usize, usize)], now: u64) {
    for _ in 0..3 {
        for a in 0..t.len() {
            for b in 0..t.len() {
                if a != b && !cut.contains(&(a, b)) && !cut.contains(&(b, a)) {
                    sync(t, a, b, now);
                }
            }
        }
    }
}

/// Region `i` of `t` dies and comes back with its state lost, as
/// incarnation `incarnation` (later than its last).
fn restart(t: &mut [GlobalTable], i: usize, incarnation: u64) {
    let name = t[i].region().to_owned();
    let peers = t[i].peers().to_vec();
    t[i] = GlobalTable::new(RegionConfig::new(name, peers, incarnation)).unwrap();
}

#[test]
fn regression_a_crashed_incarnations_unacknowledged_slice_is_charged_everywhere() {
    // 120 a minute, 5%: a slice of 2 per region, a cap of 126.
    let mut t = tables(&["a", "b", "c"]);
    sync_all(&t, 0);
    let l = fixed(120);
    let m = SyncMode::Bounded { overshoot_ppm: 50_000 };
    for round in 0..5u64 {
        // c takes its slice and dies before any batch leaves it.
        assert_eq!(admitted(&t[2], "k", &l, m, 10, S + round), 2, "round {round}");
        restart(&mut t, 2, 1_000 + round);
        assert_eq!(admitted(&t[2], "k", &l, m, 10, S + round), 0, "round {round}: not recorded by its peers yet");
        sync_all(&t, S + round);
    }
    // Five dead incarnations, each may have taken a slice: everyone counts
    // 5 x 2, so the regions admit at most 120 - 10 more, and 10 + 110 fits
    // the cap.
    for r in &t {
        assert_eq!(r.apply("k", &l, m, 0, 2 * S).unwrap().remaining, 110, "{}", r.region());
    }
    let mut total = 10;
    for round in 0..100 {
        for r in &t {
            total += admitted(r, "k", &l, m, 2, 2 * S + round);
        }
        sync_all(&t, 2 * S + round);
    }
    // Each region admits its slice beyond what it knows, as always: the
    // cap, 126, with the lost hits counted as taken.
    assert!((120..=126).contains(&total), "the limit reached, the cap kept: {total}");
    // The next window pays nothing for them.
    assert_eq!(t[0].apply("k", &l, m, 0, 61 * S).unwrap().remaining, 120);
}

#[test]
fn regression_a_new_incarnation_admits_nothing_bounded_until_every_peer_recorded_it() {
    let t = tables(&["a", "b", "c"]);
    let l = fixed(600);
    let m = SyncMode::Bounded { overshoot_ppm: 50_000 };
    assert_eq!(admitted(&t[0], "k", &l, m, 5, S), 0, "no peer knows a yet");
    sync(&t, 0, 1, S);
    assert_eq!(admitted(&t[0], "k", &l, m, 5, S), 0, "c does not know a yet");
    sync(&t, 0, 2, S);
    assert_eq!(admitted(&t[0], "k", &l, m, 5, S), 5, "recorded everywhere: its slice");
    // Eventual rules never waited for that.
    let t = tables(&["a", "b"]);
    sync(&t, 1, 0, S);
    sync(&t, 1, 0, S);
    assert_eq!(admitted(&t[0], "e", &l, SyncMode::Eventual, 5, S), 5, "b's full state arrived");
}

#[test]
fn regression_a_dead_incarnations_usage_reaches_the_region_cut_off_from_it() {
    // b and c cut off from each other; each region takes 10; c dies while
    // still cut off; the cut heals; c comes back.
    let mut t = tables(&["a", "b", "c"]);
    sync_all(&t, 0);
    let l = fixed(600);
    let e = SyncMode::Eventual;
    for r in &t {
        assert_eq!(admitted(r, "k", &l, e, 10, S), 10);
    }
    sync_but(&t, &[(1, 2)], S);
    assert_eq!(t[1].apply("k", &l, e, 0, S).unwrap().remaining, 580, "b never heard from c");
    restart(&mut t, 2, 1_000);
    sync_all(&t, 2 * S);
    // c's old hits came back to c from a, and went on from c to b.
    for r in &t {
        assert_eq!(r.apply("k", &l, e, 0, 2 * S).unwrap().remaining, 570, "{}", r.region());
    }
}

#[test]
fn a_restarted_region_learns_its_peers_dead_incarnations_and_charges_them() {
    let mut t = tables(&["a", "b", "c"]);
    sync_all(&t, 0);
    let l = fixed(120);
    let m = SyncMode::Bounded { overshoot_ppm: 50_000 };
    assert_eq!(admitted(&t[2], "k", &l, m, 10, S), 2);
    restart(&mut t, 2, 1_000);
    sync_all(&t, S);
    assert_eq!(t[1].apply("k", &l, m, 0, S).unwrap().remaining, 118);
    // b restarts too: what it knew of c's dead incarnation comes back with
    // a's full state, so it charges it as before, and its own dead one.
    restart(&mut t, 1, 2_000);
    sync_all(&t, S + 1);
    assert_eq!(t[1].apply("k", &l, m, 0, S + 1).unwrap().remaining, 116);
    assert_eq!(t[0].apply("k", &l, m, 0, S + 1).unwrap().remaining, 116, "a charges both as well");
}

#[test]
fn a_crashed_incarnation_costs_the_gcra_family_one_slice_of_debt() {
    let mut t = tables(&["a", "b", "c"]);
    sync_all(&t, 0);
    // 600 a minute, burst 600: a slice of 10, one every 100 ms.
    let l = Limit::new(Algorithm::Gcra { burst: None }, 600, Duration::from_secs(60)).unwrap();
    let m = SyncMode::Bounded { overshoot_ppm: 50_000 };
    assert_eq!(admitted(&t[2], "k", &l, m, 20, S), 10);
    restart(&mut t, 2, 1_000);
    sync_all(&t, S);
    assert_eq!(t[0].apply("k", &l, m, 0, S).unwrap().remaining, 590, "the lost slice, as debt");
    // It drains as any debt does: 10 hits' worth after a second.
    assert_eq!(t[0].apply("k", &l, m, 0, 2 * S).unwrap().remaining, 600);
}

#[test]
fn a_lost_batch_is_sent_again_and_a_refused_peer_list_says_why() {
    let t = tables(&["a", "b"]);
    sync_all(&t, 0);
    let l = fixed(20);
    let e = SyncMode::Eventual;
    admitted(&t[0], "k", &l, e, 5, S);
    let lost = t[0].next_batch(0, S).unwrap();
    t[0].on_failure(0, lost.seq);
    sync_all(&t, S);
    assert_eq!(t[1].apply("k", &l, e, 0, S).unwrap().remaining, 15);
    // Never acknowledged at all: sent again after the timeout.
    admitted(&t[0], "k", &l, e, 5, S);
    let _unanswered = t[0].next_batch(0, S).unwrap();
    let again = t[0].next_batch(0, S + 3 * S).unwrap();
    assert_eq!(again.items.len(), 1);
    t[1].receive(&again, 4 * S);
    assert_eq!(t[1].apply("k", &l, e, 0, 4 * S).unwrap().remaining, 10);

    let err = |peers: &[&str]| {
        GlobalTable::new(RegionConfig::new("a", peers.iter().map(|p| (*p).to_owned()).collect(), 1))
            .unwrap_err()
            .to_string()
    };
    assert!(err(&["a"]).contains("its own peers"));
    assert!(err(&["b", "b"]).contains("twice"));
    assert!(err(&["b c"]).contains("without spaces"));
}

mod simulated {
    use std::time::Duration;

    use crate::region::SyncMode;
    use crate::region::sim::{Pattern, Spec, run};
    use crate::{Algorithm, Limit};

    fn limit(a: Algorithm, n: u64, secs: u64) -> Limit {
        Limit::new(a, n, Duration::from_secs(secs)).unwrap()
    }

    #[test]
    fn the_same_seed_gives_the_same_report() {
        let l = limit(Algorithm::FixedWindow, 300, 10);
        let spec = Spec::goals(l, SyncMode::Eventual, Pattern::Steady, 7);
        assert_eq!(run(&spec), run(&spec));
        let other = Spec { seed: 8, ..spec.clone() };
        assert_ne!(run(&spec), run(&other), "another seed, another run");
    }

    /// Many keys in several batches an interval, and a full state transfer
    /// after a restart, went out in the order of the table's hashing, which
    /// was seeded at random: the same seed gave another table each run.
    #[test]
    fn regression_many_keys_and_a_restart_replay_with_the_same_seed() {
        for p in [Pattern::ManyKeys, Pattern::Restart] {
            let n = if p == Pattern::ManyKeys { 60 } else { 300 };
            let mut spec = Spec::goals(limit(Algorithm::Gcra { burst: None }, n, 1), SyncMode::Eventual, p, 5);
            spec.batch_items = 100;
            assert_eq!(run(&spec), run(&spec), "{}", p.as_str());
        }
    }

    /// The bounded cap in every pattern, both families (a few seeds here;
    /// `floodgate simulate --regions --goals` runs a hundred).
    #[test]
    fn the_bounded_cap_holds_in_every_pattern() {
        let bounded = SyncMode::Bounded { overshoot_ppm: 50_000 };
        for a in [Algorithm::FixedWindow, Algorithm::SlidingBuckets { granularity: 5 }, Algorithm::Gcra { burst: None }]
        {
            for p in Pattern::ALL {
                if p == Pattern::Tiny {
                    continue;
                }
                let n = if p == Pattern::ManyKeys { 60 } else { 300 };
                for seed in 1..=2 {
                    let mut spec = Spec::goals(limit(a, n, 10), bounded, p, seed);
                    if p == Pattern::ManyKeys {
                        spec.batch_items = 100;
                    }
                    let r = run(&spec);
                    assert!(r.cap_held, "{:?} {} seed {seed}: {r:?}", a.kind(), p.as_str());
                    assert!(r.admitted > 0, "{:?} {}: something is admitted", a.kind(), p.as_str());
                }
            }
        }
    }

    /// Defect: each crashed incarnation's unacknowledged slice was lost
    /// without a trace, and two or more crashes a window broke the cap.
    #[test]
    fn regression_the_bounded_cap_holds_through_a_crashloop() {
        let bounded = SyncMode::Bounded { overshoot_ppm: 50_000 };
        for a in [Algorithm::FixedWindow, Algorithm::SlidingWindow, Algorithm::Gcra { burst: None }] {
            for crashes in [1, 2, 5, 10] {
                for seed in 1..=2 {
                    let mut spec = Spec::goals(limit(a, 120, 60), bounded, Pattern::Crashloop, seed);
                    spec.crashes = crashes;
                    spec.windows = 2;
                    let r = run(&spec);
                    assert!(r.cap_held, "{:?} K={crashes} seed {seed}: {r:?}", a.kind());
                    assert!(r.admitted >= 120, "{:?} K={crashes}: the limit is still reached: {r:?}", a.kind());
                }
            }
        }
    }

    /// Defect: a region that died while cut off from another never got
    /// its last hits to it; now they come back through the third.
    #[test]
    fn regression_a_crash_during_a_partition_converges() {
        for seed in 1..=3 {
            let spec =
                Spec::goals(limit(Algorithm::FixedWindow, 600, 60), SyncMode::Eventual, Pattern::PartitionCrash, seed);
            let r = run(&spec);
            let c = r.convergence_us.expect("converged");
            assert!(c <= r.convergence_bound_us + 1_000_000, "seed {seed}: {c} us: {r:?}");
        }
    }

    /// Budget: refunds and late charges reach every region exactly; once
    /// the traffic stops every region agrees within the heal's bound (the
    /// refunds included: before they crossed regions, no seed converged).
    #[test]
    fn refunds_and_late_charges_converge_across_regions() {
        for a in [
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::SlidingBuckets { granularity: 10 },
            Algorithm::Gcra { burst: None },
        ] {
            for seed in 1..=3 {
                let r = run(&Spec::goals(limit(a, 1_000, 10), SyncMode::Eventual, Pattern::Budget, seed));
                assert!(r.refunded > 0 && r.late > 0, "{:?} seed {seed}: {r:?}", a.kind());
                let c = r.convergence_us.expect("converged");
                assert!(c <= r.convergence_bound_us, "{:?} seed {seed}: {c} us: {r:?}", a.kind());
            }
        }
    }

    /// A Redis region's instance dies right after a key's first hits, its
    /// state kept: every region learns them, and (bounded) the last region
    /// admits again once they are acknowledged.
    #[test]
    fn an_instances_death_loses_nothing_and_frees_its_slice() {
        for mode in [SyncMode::Eventual, SyncMode::Bounded { overshoot_ppm: 50_000 }] {
            let spec = Spec::goals(limit(Algorithm::FixedWindow, 1_000, 10), mode, Pattern::InstanceCrash, 4);
            let r = run(&spec);
            assert!(r.convergence_us.is_some_and(|c| c <= r.convergence_bound_us + 1_000_000), "{mode:?}: {r:?}");
            assert!(r.by_region[2] > spec.burst_before_crash(), "{mode:?}: the last region admits again: {r:?}");
        }
    }

    #[test]
    fn eventual_over_admission_stays_within_the_staleness_bound() {
        for secs in [1, 10] {
            let r =
                run(&Spec::goals(limit(Algorithm::FixedWindow, 1_000, secs), SyncMode::Eventual, Pattern::Steady, 3));
            assert!(r.worst_over as f64 <= 1.25 * r.staleness, "{secs}s: {r:?}");
            assert!(r.false_denials * 100 <= r.exact, "{secs}s: {r:?}");
        }
    }

    /// Lazy sync's worst case (`Pattern::Trickle`): one region trickles
    /// 80 of 1 000 in half a second, another then asks for everything.
    /// Beyond what staleness allows, the waiting hits add at most 1% of the
    /// limit (they added all 80 when hits could wait up to a sixth of what
    /// is left).
    #[test]
    fn lazy_sync_adds_at_most_one_percent_beyond_staleness() {
        for seed in 1..=3 {
            let spec = Spec::goals(limit(Algorithm::FixedWindow, 1_000, 1), SyncMode::Eventual, Pattern::Trickle, seed);
            let r = run(&spec);
            let stale = (spec.interval_us + spec.wan.latency_us[1][0] + spec.wan.jitter_us) as f64;
            let bound = 1.25 * 80.0 / 500_000.0 * stale + 10.0;
            assert!(r.worst_over as f64 <= bound, "seed {seed}: {} over, bound {bound}: {r:?}", r.worst_over);
            assert!(r.worst_over > 0, "the burst comes before the trickle's last hits arrive");
            assert!(r.false_denials * 100 <= r.exact, "seed {seed}: {r:?}");
        }
    }

    #[test]
    fn a_healed_partition_converges_within_the_bound() {
        let r = run(&Spec::goals(limit(Algorithm::FixedWindow, 300, 10), SyncMode::Eventual, Pattern::Partition, 5));
        let c = r.convergence_us.expect("converged");
        assert!(c <= r.convergence_bound_us, "{c} µs, bound {} µs", r.convergence_bound_us);
    }
}

#[test]
fn a_key_far_below_its_limit_waits_for_the_lazy_period_and_one_near_it_does_not() {
    let t = tables(&["a", "b"]);
    sync_all(&t, 0);
    let l = fixed(100_000);
    let e = SyncMode::Eventual;
    assert_eq!(admitted(&t[0], "far", &l, e, 5, S), 5);
    let b = t[0].next_batch(0, S + 1).unwrap();
    assert!(b.items.is_empty(), "5 hits of 100 000: nothing can go wrong before the lazy period ends");
    t[0].on_ack(0, &t[1].receive(&b, S + 1).ack, S + 1);
    // The lazy period (1 s) over: sent.
    let b = t[0].next_batch(0, 2 * S).unwrap();
    assert_eq!(b.items.len(), 1);
    t[1].receive(&b, 2 * S);
    assert_eq!(t[1].apply("far", &l, e, 0, 2 * S).unwrap().remaining, 99_995);
    // 497 hits not yet sent, 99 503 left: 497 x 100 x 2 regions < 99 503,
    // still waiting; one more and they could add 1% of what is left to
    // over-admission: at the next batch.
    assert_eq!(admitted(&t[0], "near", &l, e, 497, 2 * S), 497);
    assert!(t[0].next_batch(0, 2 * S + 1).is_none_or(|b| b.items.is_empty()));
    assert_eq!(admitted(&t[0], "near", &l, e, 1, 2 * S + 2), 1);
    let b = t[0].next_batch(0, 2 * S + 3).unwrap();
    assert_eq!(b.items.len(), 1, "{b:?}");
}
