use super::*;

fn tick<'a>(now: u64, rules: Vec<(&'a Arc<str>, Totals)>) -> Tick<'a> {
    Tick {
        now,
        rules,
        shards: vec![ShardView {
            addr: "memory".into(),
            breaker_open: false,
            opened_total: 0,
        }],
        store_errors: 0,
        upstream: [0, 0],
    }
}

#[test]
fn series_are_per_second_deltas_and_idle_rules_cost_no_ring() {
    let a = Activity::new(1000);
    let (busy, idle): (Arc<str>, Arc<str>) = ("busy".into(), "idle".into());
    a.sample(tick(1000, vec![(&busy, [5, 1, 0]), (&idle, [0, 0, 0])]));
    a.sample(tick(1001, vec![(&busy, [8, 1, 2]), (&idle, [0, 0, 0])]));
    // The sampler was two seconds late: one zero second, then the counts.
    a.sample(tick(1004, vec![(&busy, [9, 4, 2]), (&idle, [0, 0, 0])]));
    let s = a.series("busy");
    assert_eq!(s.per_second.len(), SERIES_SECONDS);
    let tail = &s.per_second[SERIES_SECONDS - 5..];
    assert_eq!(tail, &[[5, 1, 0], [3, 0, 2], [0, 0, 0], [0, 0, 0], [1, 3, 0]]);
    assert_eq!(s.sums, [9, 4, 2]);
    assert!(
        a.series("idle").per_second.is_empty(),
        "no ring for a rule without traffic"
    );
    // A removed rule's series goes.
    a.sample(tick(1005, vec![(&idle, [0, 0, 0])]));
    assert!(a.series("busy").per_second.is_empty());
}

#[test]
fn top_limited_counts_per_hash_and_rule_in_the_window() {
    let a = Activity::new(600);
    let r: Arc<str> = "login".into();
    let h1 = "aaaaaaaaaaaaaaaaaaaaaaaa";
    let h2 = "bbbbbbbbbbbbbbbbbbbbbbbb";
    for _ in 0..5 {
        a.denied(h1, &r, "ip");
    }
    a.denied(h2, &r, "ip");
    a.denied("not-a-tag", &r, "ip");
    let top = a.top_limited(10);
    assert_eq!(top.len(), 2);
    assert_eq!((top[0].hash.as_str(), top[0].denials), (h1, 5));
    assert_eq!((top[1].hash.as_str(), top[1].denials), (h2, 1));
    // Six minutes later, the old minute is out of the window.
    a.now.store(600 + 360, Ordering::Relaxed);
    assert!(a.top_limited(10).is_empty());
}

#[test]
fn topk_stays_bounded_and_keeps_the_heavy_hitter() {
    let a = Activity::new(60);
    let r: Arc<str> = "r".into();
    for i in 0..1000u32 {
        a.denied("cccccccccccccccccccccccc", &r, "user");
        a.denied(&format!("{i:024x}"), &r, "user");
    }
    let top = a.top_limited(100);
    assert_eq!(top.len(), TOPK_PER_MINUTE);
    assert_eq!(top[0].hash, "cccccccccccccccccccccccc");
    assert!(top[0].denials >= 1000);
}

#[test]
fn store_changes_are_recorded_as_events() {
    let a = Activity::new(10);
    let shard = |addr: &str, open: bool, n: u64| ShardView {
        addr: addr.into(),
        breaker_open: open,
        opened_total: n,
    };
    let mut t = tick(10, vec![]);
    t.shards = vec![shard("a:1", false, 0), shard("b:1", false, 0)];
    a.sample(t.clone());
    t.now = 11;
    t.shards = vec![shard("a:1", true, 1), shard("b:1", false, 0)];
    a.sample(t.clone());
    t.now = 12;
    t.shards = vec![shard("a:1", true, 1), shard("c:1", false, 0)];
    a.sample(t);
    let (shards, events, _) = a.store();
    assert_eq!(shards.len(), 2);
    let what: Vec<&str> = events.iter().map(|e| e.what.as_str()).collect();
    assert_eq!(
        what,
        [
            "shard b:1 left (failover or resharding)",
            "shard c:1 joined (failover or resharding)",
            "shard a:1: breaker opened",
            "started: a:1, b:1 (ok)"
        ]
    );
    assert_eq!(events[2].state, "degraded");
}
