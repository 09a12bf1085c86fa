//! Sampling decisions and the span made of a finished request.

use super::*;

fn trace(n: u64, parent: bool, flags: u8) -> TraceContext {
    let mut trace_id = [7u8; 16];
    trace_id[8..].copy_from_slice(&n.to_be_bytes());
    TraceContext {
        trace_id,
        span_id: [1; 8],
        parent_id: parent.then_some([2; 8]),
        flags,
    }
}

#[test]
fn the_ratio_picks_that_share_of_trace_ids() {
    let spread = |r: f64| {
        let s = Sampling::new(r, false);
        (0..10_000u64)
            .filter(|i| s.picks(&trace(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), false, 0)))
            .count()
    };
    assert_eq!(spread(0.0), 0);
    assert_eq!(spread(1.0), 10_000);
    let tenth = spread(0.1);
    assert!((800..1200).contains(&tenth), "{tenth}");
}

#[test]
fn parent_based_follows_the_incoming_flag_and_only_with_a_parent() {
    let s = Sampling::new(0.0, true);
    assert!(s.picks(&trace(1, true, 1)));
    assert!(!s.picks(&trace(1, true, 0)));
    assert!(!s.picks(&trace(1, false, 1)), "no parent: the ratio decides");
    let s = Sampling::new(0.0, false);
    assert!(!s.picks(&trace(1, true, 1)), "the flag is ignored by default");
}

#[test]
fn denials_fail_opens_errors_and_aborts_are_always_exported() {
    assert!(Exporter::always("limited", 429, false, false));
    assert!(Exporter::always("fail_open", 200, true, false));
    assert!(Exporter::always("allowed", 502, false, false));
    assert!(Exporter::always("client_aborted", 499, false, true));
    assert!(Exporter::always("allowed", 200, false, true), "aborted mid-body");
    assert!(!Exporter::always("allowed", 200, false, false));
    assert!(!Exporter::always("unmatched", 404, false, false));
}

#[test]
fn a_span_has_the_request_ids_and_times() {
    let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let f = Finished {
        trace: trace(5, true, 0),
        start,
        end: start + Duration::from_millis(3),
        method: http::Method::POST,
        path: "/x".into(),
        status: 429,
        decision: "limited",
        rule: Some("r".into()),
        binding: Some(BindingLimit {
            limit: 5,
            window_ms: 1000,
            remaining: 0,
        }),
        fail_open: false,
        store_us: None,
        target: None,
        attempts: 0,
        upstream_us: 0,
        client_aborted: false,
    };
    let d = span_data(f, &InstrumentationScope::builder("t").build());
    assert_eq!(d.span_context.span_id(), SpanId::from_bytes([1; 8]));
    assert_eq!(d.parent_span_id, SpanId::from_bytes([2; 8]));
    assert!(d.parent_span_is_remote && d.span_context.is_sampled());
    assert_eq!(
        d.end_time.duration_since(d.start_time).ok(),
        Some(Duration::from_millis(3))
    );
    assert_eq!(d.name, "POST");
    let has = |k: &str| d.attributes.iter().any(|kv| kv.key.as_str() == k);
    assert!(has("tollgate.binding.limit") && has("tollgate.rule") && !has("tollgate.upstream.target"));
}

#[test]
fn a_caller_cannot_choose_trace_ids_that_are_always_picked() {
    // Ids whose low 64 bits are tiny were always under the threshold before the keyed hash.
    let s = Sampling::new(0.01, false);
    let picked = (0..10_000u64).filter(|i| s.picks(&trace(*i, true, 0))).count();
    assert!(
        (40..=200).contains(&picked),
        "{picked} of 10000 small ids picked at 1 %"
    );
}
