//! Tests of the streaming usage scanner (`super`).

use super::*;

fn paths(list: &[&str]) -> Vec<JsonPath> {
    list.iter().map(|p| JsonPath::parse(p).unwrap()).collect()
}

type Outcome = (Vec<Option<u64>>, Completeness);

fn scan_chunks<'a>(list: &[&str], kind: BodyKind, chunks: impl IntoIterator<Item = &'a [u8]>) -> Outcome {
    let mut s = Scanner::new(&paths(list), kind);
    for c in chunks {
        s.feed(c);
    }
    let c = s.finish();
    assert_eq!(s.finish(), c, "finish is idempotent");
    ((0..list.len()).map(|i| s.found(i)).collect(), c)
}

fn scan(list: &[&str], kind: BodyKind, body: &[u8]) -> Outcome {
    scan_chunks(list, kind, [body])
}

fn json(list: &[&str], body: &str) -> Outcome {
    scan(list, BodyKind::Json, body.as_bytes())
}

fn sse(list: &[&str], body: &str) -> Outcome {
    scan(list, BodyKind::EventStream, body.as_bytes())
}

/// One chunk, one byte at a time, and every two-chunk split agree; returns the outcome.
fn check_splits(list: &[&str], kind: BodyKind, body: &[u8]) -> Outcome {
    let whole = scan(list, kind, body);
    assert_eq!(scan_chunks(list, kind, body.chunks(1)), whole, "byte at a time");
    for k in 0..=body.len() {
        let (a, b) = body.split_at(k);
        assert_eq!(scan_chunks(list, kind, [a, b]), whole, "split at {k}");
    }
    whole
}

use Completeness::{Complete, Malformed, Truncated};

// ---- JsonPath ----

#[test]
fn path_parse_valid() {
    let p = JsonPath::parse("usage.total_tokens").unwrap();
    assert_eq!(p.as_str(), "usage.total_tokens");
    assert_eq!(p.to_string(), "usage.total_tokens");
    assert_eq!(p.segments, ["usage", "total_tokens"]);
    let sixteen = vec!["a"; 16].join(".");
    assert!(JsonPath::parse(&sixteen).is_ok());
    let long = "k".repeat(64);
    assert!(JsonPath::parse(&format!("{long}.x")).is_ok());
    assert_eq!(JsonPath::parse("max_tokens").unwrap().segments, ["max_tokens"]);
    assert_eq!(JsonPath::parse("with space.é").unwrap().segments, ["with space", "é"]);
}

#[test]
fn path_parse_errors() {
    let e = JsonPath::parse("").unwrap_err();
    assert!(e.contains("empty"), "{e}");
    for bad in [".a", "a.", "a..b", "."] {
        let e = JsonPath::parse(bad).unwrap_err();
        assert!(e.contains("empty segment"), "{bad}: {e}");
    }
    let e = JsonPath::parse(&vec!["a"; 17].join(".")).unwrap_err();
    assert!(e.contains("17 segments") && e.contains("at most 16"), "{e}");
    let e = JsonPath::parse(&format!("usage.{}", "k".repeat(65))).unwrap_err();
    assert!(e.contains("segment 2 is 65 bytes") && e.contains("at most 64"), "{e}");
}

// ---- BodyKind ----

#[test]
fn body_kind_of_content_type() {
    let of = |s: &str| BodyKind::of_content_type(Some(s.as_bytes()));
    assert_eq!(BodyKind::of_content_type(None), BodyKind::Json);
    assert_eq!(of("application/json"), BodyKind::Json);
    assert_eq!(of("text/event-stream"), BodyKind::EventStream);
    assert_eq!(of("Text/Event-Stream; charset=utf-8"), BodyKind::EventStream);
    assert_eq!(of("  text/event-stream ;x=y"), BodyKind::EventStream);
    assert_eq!(of("text/event-streamx"), BodyKind::Json);
    assert_eq!(of("text/plain; text/event-stream"), BodyKind::Json);
    assert_eq!(of(""), BodyKind::Json);
}

// ---- Matching ----

#[test]
fn matches_exact_chain_of_object_keys() {
    let body = r#"{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
    let (found, c) = json(
        &["usage.total_tokens", "usage.prompt_tokens", "usage", "total_tokens"],
        body,
    );
    assert_eq!(found, [Some(7), Some(3), None, None]);
    assert_eq!(c, Complete);
    // Deeper or shallower chains do not match.
    assert_eq!(
        json(&["usage.total_tokens"], r#"{"x":{"usage":{"total_tokens":5}}}"#).0,
        [None]
    );
    assert_eq!(json(&["usage.total_tokens"], r#"{"total_tokens":5}"#).0, [None]);
    assert_eq!(
        json(&["usage.total_tokens"], r#"{"usage":{"total_tokens":{"v":5}}}"#).0,
        [None]
    );
    // A sibling with the leaf's name at the wrong level does not match.
    let body = r#"{"usage":{"n":{"total_tokens":1}},"total_tokens":2,"x":{"total_tokens":3}}"#;
    assert_eq!(json(&["usage.total_tokens"], body).0, [None]);
    // The match survives nested siblings before the key.
    let body = r#"{"usage":{"a":{"b":[1,{"c":2}]},"total_tokens":9},"z":[]}"#;
    assert_eq!(json(&["usage.total_tokens"], body), (vec![Some(9)], Complete));
}

#[test]
fn arrays_never_match() {
    let p = &["usage.total_tokens", "a.usage.total_tokens"];
    assert_eq!(
        json(p, r#"{"a":[{"usage":{"total_tokens":9}}]}"#),
        (vec![None, None], Complete)
    );
    assert_eq!(
        json(p, r#"[{"usage":{"total_tokens":9}}]"#),
        (vec![None, None], Complete)
    );
    assert_eq!(
        json(&["usage.total_tokens"], r#"{"usage":[{"total_tokens":9}]}"#).0,
        [None]
    );
    assert_eq!(
        json(&["usage.total_tokens"], r#"{"usage":{"total_tokens":[9]}}"#).0,
        [None]
    );
    // After an array closes, the enclosing object's keys match again.
    let body = r#"{"a":[{"usage":{"total_tokens":9}}],"usage":{"total_tokens":4}}"#;
    assert_eq!(json(&["usage.total_tokens"], body).0, [Some(4)]);
}

#[test]
fn keys_are_unescaped() {
    assert_eq!(
        json(&["usage.total_tokens"], r#"{"\u0075sage":{"tot\u0061l_tokens":5}}"#).0,
        [Some(5)]
    );
    assert_eq!(
        json(&["usage.total_tokens"], r#"{"usage":{"TOT\u0041L_tokens":5}}"#).0,
        [None]
    );
    let simple = r#"{"a\"b":1,"c\\d":2,"e\/f":3,"g\nh":4,"i\tj\b\f\r":5}"#;
    let (found, c) = json(&["a\"b", "c\\d", "e/f", "g\nh", "i\tj\u{8}\u{c}\r"], simple);
    assert_eq!(found, [Some(1), Some(2), Some(3), Some(4), Some(5)]);
    assert_eq!(c, Complete);
    // Non-ASCII: \u escapes, surrogate pairs, raw UTF-8.
    let body = r#"{"\u00e9t\u00E9":1,"\ud83d\ude00":2,"😀x":3,"caf\u00e9":4}"#;
    assert_eq!(
        json(&["été", "😀", "😀x", "café"], body).0,
        [Some(1), Some(2), Some(3), Some(4)]
    );
    // Unpaired surrogates become U+FFFD and never panic.
    let body = r#"{"\ud83d":1,"\ude00x":2,"\ud83d\u0041":3,"\ud83d\ud83d\ude00":4}"#;
    assert_eq!(
        json(&["\u{FFFD}", "\u{FFFD}x", "\u{FFFD}A", "\u{FFFD}😀"], body).0,
        [Some(1), Some(2), Some(3), Some(4)]
    );
}

#[test]
fn long_keys_cannot_match() {
    let k64 = "k".repeat(64);
    let k65 = "k".repeat(65);
    let body = format!(r#"{{"{k65}":1,"{k64}":2}}"#);
    assert_eq!(json(&[&k64], &body), (vec![Some(2)], Complete));
    // A long key that shares the path's prefix.
    let body = format!(r#"{{"{k64}x":1}}"#);
    assert_eq!(json(&[&k64], &body).0, [None]);
    // A long escaped key.
    let body = format!(r#"{{"{}":1,"a":2}}"#, "\\u0041".repeat(100));
    assert_eq!(json(&["a"], &body), (vec![Some(2)], Complete));
}

#[test]
fn duplicates_take_the_largest() {
    assert_eq!(
        json(&["max_tokens"], r#"{"max_tokens":1,"max_tokens":4000}"#).0,
        [Some(4000)]
    );
    assert_eq!(
        json(&["max_tokens"], r#"{"max_tokens":4000,"max_tokens":1}"#).0,
        [Some(4000)]
    );
    let body = r#"{"usage":{"total_tokens":5},"usage":{"total_tokens":50},"usage":{"total_tokens":2}}"#;
    assert_eq!(json(&["usage.total_tokens"], body).0, [Some(50)]);
    // The same path listed twice is reported twice.
    assert_eq!(json(&["a", "a"], r#"{"a":3}"#).0, [Some(3), Some(3)]);
}

#[test]
fn request_top_level_field() {
    let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"max_tokens: 99"}],"max_tokens":256}"#;
    assert_eq!(json(&["max_tokens"], body), (vec![Some(256)], Complete));
    let body = r#"{"model":"x","messages":[{"max_tokens":99999}],"n":{"max_tokens":7}}"#;
    assert_eq!(json(&["max_tokens"], body), (vec![None], Complete));
}

#[test]
fn usable_numbers() {
    let cases: &[(&str, Option<u64>)] = &[
        ("0", Some(0)),
        ("42", Some(42)),
        ("18446744073709551615", Some(u64::MAX)),
        ("18446744073709551616", Some(u64::MAX)),
        ("99999999999999999999999999", Some(u64::MAX)),
        ("-5", Some(0)),
        ("-0", Some(0)),
        ("1.5", Some(2)),
        ("2.0", Some(2)),
        ("0.0001", Some(1)),
        ("0.0", Some(0)),
        ("-1.5", Some(0)),
        ("1e3", Some(1000)),
        ("1E+2", Some(100)),
        ("25e-1", Some(3)),
        ("1e-5", Some(1)),
        ("-1e5", Some(0)),
        ("1e400", Some(u64::MAX)),
        ("1.8446744073709552e19", Some(u64::MAX)),
        ("18446744073709551615.5", Some(u64::MAX)),
        ("9007199254740993.5", Some(9007199254740994)),
        (r#""4000""#, Some(4000)),
        (r#"" 12 ""#, Some(12)),
        (r#""\t12\n""#, Some(12)),
        (r#""1.5""#, Some(2)),
        (r#""-3""#, Some(0)),
        (r#""+7""#, Some(7)),
        (r#""007""#, Some(7)),
        (r#""1.""#, Some(1)),
        (r#"".5""#, Some(1)),
        (r#""2e2""#, Some(200)),
        (r#""\u0034\u0032""#, Some(42)),
        (r#""abc""#, None),
        (r#""""#, None),
        (r#""  ""#, None),
        (r#""12abc""#, None),
        (r#""1 2""#, None),
        (r#""inf""#, None),
        (r#""NaN""#, None),
        (r#""-""#, None),
        (r#""1e""#, None),
        (r#""0x10""#, None),
        ("null", None),
        ("true", None),
        ("false", None),
        ("{}", None),
        (r#"{"a":1}"#, None),
        ("[1]", None),
        ("[]", None),
    ];
    for &(value, want) in cases {
        let body = format!(r#"{{"n":{value}}}"#);
        assert_eq!(json(&["n"], &body), (vec![want], Complete), "{body}");
        // The same at the end of an object with whitespace, and split everywhere.
        let body = format!("{{ \"n\" : {value} , \"m\" : 1 }}");
        assert_eq!(
            check_splits(&["n"], BodyKind::Json, body.as_bytes()),
            (vec![want], Complete),
            "{body}"
        );
    }
}

#[test]
fn long_values() {
    let d41 = "9".repeat(41);
    let d40 = format!("1{}", "0".repeat(39));
    assert_eq!(json(&["n"], &format!(r#"{{"n":{d41}}}"#)).0, [Some(u64::MAX)]);
    assert_eq!(json(&["n"], &format!(r#"{{"n":{d40}}}"#)).0, [Some(u64::MAX)]);
    assert_eq!(json(&["n"], &format!(r#"{{"n":"{d41}"}}"#)).0, [Some(u64::MAX)]);
    // Long but not all digits: too long to read exactly, so the most it could be (a
    // reader takes `4000.000…0` for 4000; a hostile body must not reserve less for it).
    let frac = format!("4000.{}", "0".repeat(50));
    assert_eq!(
        json(&["n"], &format!(r#"{{"n":{frac}}}"#)),
        (vec![Some(u64::MAX)], Complete)
    );
    assert_eq!(json(&["n"], &format!(r#"{{"n":1,"n":{frac}}}"#)).0, [Some(u64::MAX)]);
    assert_eq!(
        json(&["n"], &format!(r#"{{"n":-{d41}}}"#)),
        (vec![Some(u64::MAX)], Complete)
    );
    assert_eq!(
        json(&["n"], &format!(r#"{{"n":"{}"}}"#, "x".repeat(50))),
        (vec![Some(u64::MAX)], Complete)
    );
    assert_eq!(
        json(&["n"], &format!(r#"{{"n":"4000{}"}}"#, " ".repeat(40))),
        (vec![Some(u64::MAX)], Complete)
    );
    // A 40-byte string is still parsed.
    assert_eq!(json(&["n"], &format!(r#"{{"n":"{}5"}}"#, " ".repeat(39))).0, [Some(5)]);
    // An unusable short value leaves an earlier one alone.
    assert_eq!(json(&["n"], r#"{"n":5,"n":"x"}"#).0, [Some(5)]);
}

#[test]
fn unusable_values_leave_found_alone() {
    assert_eq!(
        json(&["t"], r#"{"t":5,"t":null,"t":"x","t":{"a":9},"t":[9],"t":true}"#),
        (vec![Some(5)], Complete)
    );
    assert_eq!(json(&["t"], r#"{"t":null}"#), (vec![None], Complete));
}

#[test]
fn numbers_count_when_their_token_ends() {
    // Truncated inside the object: the number ended with the body.
    assert_eq!(
        json(&["usage.total_tokens"], r#"{"usage":{"total_tokens":12"#),
        (vec![Some(12)], Truncated)
    );
    // Split inside the number: only the whole number counts.
    let (found, c) = scan_chunks(&["n"], BodyKind::Json, [&b"{\"n\":12"[..], b"3}"]);
    assert_eq!((found, c), (vec![Some(123)], Complete));
    // An incomplete number at the end counts nothing.
    assert_eq!(json(&["n"], r#"{"n":12."#), (vec![None], Truncated));
    assert_eq!(json(&["n"], r#"{"n":-"#), (vec![None], Truncated));
    assert_eq!(json(&["n"], r#"{"n":1e"#), (vec![None], Truncated));
    // A string counts only once closed.
    assert_eq!(json(&["n"], r#"{"n":"12"#), (vec![None], Truncated));
    // A number followed by a syntax error still counted (its token ended).
    assert_eq!(json(&["n"], r#"{"n":12 x"#), (vec![Some(12)], Malformed));
    // A number running into garbage is malformed and does not count.
    assert_eq!(json(&["n"], r#"{"n":12x}"#), (vec![Some(12)], Malformed));
    assert_eq!(json(&["n"], r#"{"n":1.x}"#), (vec![None], Malformed));
}

// ---- JSON validation ----

#[test]
fn json_completeness() {
    let cases: &[(&[u8], Completeness)] = &[
        (b"", Truncated),
        (b"  \n\t ", Truncated),
        (b"{}", Complete),
        (b" {} \r\n", Complete),
        (b"\xEF\xBB\xBF{}", Complete),
        (b"\xEF\xBB\xBF", Truncated),
        (b"\xEF\xBB{}", Malformed),
        (b"\xEF", Malformed),
        (b"\xEF{}", Malformed),
        (b"{} \xEF\xBB\xBF", Malformed),
        (b"42", Complete),
        (b"-0.5e+7 ", Complete),
        (b"\"x\"", Complete),
        (b"true", Complete),
        (b"tru", Truncated),
        (b"trux", Malformed),
        (b"nul", Truncated),
        (b"null", Complete),
        (b"false", Complete),
        (b"truefalse", Malformed),
        (b"[1,2,[3,{\"a\":[]}]]", Complete),
        (b"{} {}", Malformed),
        (b"{}x", Malformed),
        (b"{}}", Malformed),
        (b"{", Truncated),
        (b"{\"a\"", Truncated),
        (b"{\"a\":", Truncated),
        (b"{\"a\":1,", Truncated),
        (b"[1,", Truncated),
        (b"{]", Malformed),
        (b"[}", Malformed),
        (b"[1}", Malformed),
        (b"{\"a\":1]", Malformed),
        (b"[1,]", Malformed),
        (b"[,1]", Malformed),
        (b"{\"a\":1,}", Malformed),
        (b"{,}", Malformed),
        (b"{\"a\" 1}", Malformed),
        (b"{\"a\"::1}", Malformed),
        (b"{1:1}", Malformed),
        (b"{\"a\":1 \"b\":2}", Malformed),
        (b"[1 2]", Malformed),
        (b"01", Malformed),
        (b"-", Truncated),
        (b"-a", Malformed),
        (b"1.", Truncated),
        (b"1.e5", Malformed),
        (b".5", Malformed),
        (b"+1", Malformed),
        (b"1e+", Truncated),
        (b"1e+x", Malformed),
        (b"\"\\x\"", Malformed),
        (b"\"\\u12G4\"", Malformed),
        (b"\"\\u12", Truncated),
        (b"\"a\nb\"", Malformed),
        (b"\"a\x01\"", Malformed),
        (b"\"\x7F\xFF\xC3\xA9\"", Complete),
        (b"\"abc", Truncated),
        (b"\"abc\\", Truncated),
        (b"garbage", Malformed),
        (b"]", Malformed),
        (b"\x00", Malformed),
        (b"NaN", Malformed),
        (b"[[[[]]]]", Complete),
        (b"[[[[]]]", Truncated),
        (b"[[[[]]]]]", Malformed),
    ];
    for &(body, want) in cases {
        assert_eq!(
            scan(&["a"], BodyKind::Json, body).1,
            want,
            "{}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(
            check_splits(&["a"], BodyKind::Json, body).1,
            want,
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}

#[test]
fn json_ignores_input_after_malformed_and_after_finish() {
    let mut s = Scanner::new(&paths(&["n"]), BodyKind::Json);
    s.feed(b"{\"n\":1}x");
    s.feed(b"{\"n\":99}");
    assert_eq!(s.fed(), 16);
    assert_eq!(s.finish(), Malformed);
    assert_eq!(s.found(0), Some(1));

    let mut s = Scanner::new(&paths(&["n"]), BodyKind::Json);
    s.feed(b"{\"n\":1}");
    assert_eq!(s.finish(), Complete);
    s.feed(b"garbage");
    assert_eq!(s.finish(), Complete);
    assert_eq!(s.fed(), 14);
    assert_eq!(s.found(0), Some(1));
    assert_eq!(s.found(1), None);
    assert_eq!(s.found(usize::MAX), None);
}

#[test]
fn no_paths_still_validates() {
    assert_eq!(scan(&[], BodyKind::Json, br#"{"a":[1,2]}"#), (vec![], Complete));
    assert_eq!(scan(&[], BodyKind::Json, br#"{"a":[1,2}"#), (vec![], Malformed));
}

// ---- Depth ----

fn nested(depth: usize, open: &str, close: &str, inner: &str) -> String {
    format!("{}{inner}{}", open.repeat(depth), close.repeat(depth))
}

#[test]
fn deep_nesting() {
    // Within the tracked depth, mismatched closers are caught.
    assert_eq!(json(&[], &nested(64, "[", "]", "")).1, Complete);
    assert_eq!(
        json(&[], &format!("{}}}{}", "[".repeat(64), "]".repeat(63))).1,
        Malformed
    );
    assert_eq!(json(&[], &nested(60, r#"{"a":"#, "}", "1")).1, Complete);
    // Deeper than tracked: still validated for balance and member syntax.
    assert_eq!(json(&[], &nested(50_000, "[", "]", "")).1, Complete);
    assert_eq!(json(&[], &nested(5_000, r#"{"a":"#, "}", "1")).1, Complete);
    assert_eq!(json(&[], &format!("{}]", nested(500, "[", "]", ""))).1, Malformed);
    assert_eq!(json(&[], &nested(500, "[", "]", "")[..999]).1, Truncated);
    assert_eq!(json(&[], &nested(500, r#"{"a":"#, "}", r#"{"b" 1}"#)).1, Malformed);
    assert_eq!(json(&[], &nested(500, r#"{"a":"#, "}", "[1,]")).1, Malformed);
    // Too deep.
    assert_eq!(json(&[], &"[".repeat(100_000)).1, Truncated);
    assert_eq!(json(&[], &"[".repeat(100_001)).1, Malformed);
    // 1 MiB of `[`: constant memory, stops at the limit.
    let mut s = Scanner::new(&paths(&["a"]), BodyKind::Json);
    s.feed(&vec![b'['; 1 << 20]);
    assert_eq!(s.finish(), Malformed);
}

#[test]
fn untracked_depth_learns_container_kinds() {
    for depth in [10, 63, 64, 65, 66, 100, 300] {
        for obj in [true, false] {
            let body = deep_body(depth, obj);
            assert_eq!(check_depth(&body), Complete, "depth {depth} obj {obj}");
            // Breaking the innermost member syntax is still caught deep down.
            let bad = body.replacen("\"k\":0", "\"k\" 0", 1).replacen("[0,", "[0 ", 1);
            assert_eq!(check_depth(&bad), Malformed, "depth {depth} obj {obj}");
        }
    }
    // In an untracked container, a string member followed by `}` is never valid.
    let body = format!("{}{}", "[".repeat(70), r#"[],"a"}"#);
    assert_eq!(json(&[], &body).1, Malformed);
    // Nor is a key without a value, or a member after `:` missing.
    let body = format!("{}{}", "[".repeat(70), r#"[],"a":}"#);
    assert_eq!(json(&[], &body).1, Malformed);
    // The documented leniency: right after a nested container closes at an untracked
    // depth, either closer is accepted.
    let body = format!("{}[]}}{}", "[".repeat(70), "]".repeat(69));
    assert_eq!(json(&[], &body).1, Complete);
    let body = format!("{}[]}}{}", "[".repeat(60), "]".repeat(59));
    assert_eq!(json(&[], &body).1, Malformed);
}

/// Nested containers alternating between objects and arrays, with siblings after each
/// child, so that a scan returns to untracked levels and must learn their kinds again.
fn deep_body(depth: usize, obj: bool) -> String {
    if depth == 0 {
        return "0".into();
    }
    let child = deep_body(depth - 1, !obj);
    if obj {
        format!(r#"{{"k":{child},"s":"v","n":[1,{{}}],"o":{{"x":[]}}}}"#)
    } else {
        format!(r#"[{child},"v",1,{{"x":2}},[],"w"]"#)
    }
}

fn check_depth(body: &str) -> Completeness {
    json(&["k"], body).1
}

#[test]
fn paths_match_at_moderate_depth() {
    let path = vec!["k"; 16].join(".");
    let body = format!("{}7{}", r#"{"k":"#.repeat(16), "}".repeat(16));
    assert_eq!(json(&[&path], &body), (vec![Some(7)], Complete));
    let body = format!("{}7{}", r#"{"k":"#.repeat(17), "}".repeat(17));
    assert_eq!(json(&[&path], &body), (vec![None], Complete));
}

#[test]
fn scanner_is_small_send_and_static() {
    fn assert_send_static<T: Send + 'static>() {}
    assert_send_static::<Scanner>();
    let size = std::mem::size_of::<Scanner>();
    assert!(size <= 256, "Scanner is {size} bytes");
}

// ---- Event streams ----

#[test]
fn sse_openai_include_usage() {
    let body = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n\
                data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}\n\n\
                data: [DONE]\n\n";
    let p = &["usage.total_tokens", "usage.prompt_tokens", "usage.completion_tokens"];
    assert_eq!(sse(p, body), (vec![Some(21), Some(9), Some(12)], Complete));
    assert_eq!(sse(p, &body.replace('\n', "\r\n")).0, [Some(21), Some(9), Some(12)]);
    assert_eq!(
        sse(p, &body.replace('\n', "\r")),
        (vec![Some(21), Some(9), Some(12)], Complete)
    );
    // Without the space after the colon.
    assert_eq!(
        sse(p, &body.replace("data: ", "data:")),
        (vec![Some(21), Some(9), Some(12)], Complete)
    );
}

#[test]
fn sse_cr_then_lf_across_chunks_is_one_line_end() {
    // Were the `\n` after a chunk-final `\r` a second line end, it would be a blank line
    // ending the event in the middle of its JSON.
    let body: &[&[u8]] = &[b"data: {\"n\":\r", b"\ndata: 5}\r", b"\n\r", b"\n"];
    assert_eq!(
        scan_chunks(&["n"], BodyKind::EventStream, body.iter().copied()),
        (vec![Some(5)], Complete)
    );
    // A CR followed by a CR is a blank line.
    assert_eq!(sse(&["n"], "data: {\"n\":\r\rdata: 5}\r\r"), (vec![None], Malformed));
    // A CR then an LF in separate chunks joins the two data lines into one event.
    let body: &[&[u8]] = &[b"data: {\"n\":1}\r", b"\ndata: {\"n\":2}\r\n\r\n"];
    assert_eq!(
        scan_chunks(&["n"], BodyKind::EventStream, body.iter().copied()),
        (vec![Some(1)], Malformed)
    );
}

#[test]
fn sse_multiple_data_lines_are_joined() {
    let body = "data: {\"usage\":\ndata: {\"total_tokens\":\ndata: 33}}\n\n";
    assert_eq!(sse(&["usage.total_tokens"], body), (vec![Some(33)], Complete));
    // The join is a newline, which separates tokens.
    assert_eq!(sse(&["n"], "data: {\"n\":1\ndata: 2}\n\n"), (vec![Some(1)], Malformed));
    // `data` alone is a data line with an empty value.
    assert_eq!(
        sse(&["n"], "data: {\"n\":\ndata\ndata: 4}\n\n"),
        (vec![Some(4)], Complete)
    );
}

#[test]
fn sse_ignores_comments_other_fields_and_dataless_events() {
    let body = ": keep-alive\n\
                event: message\nid: 7\nretry: 1000\nfoo: bar\ndatum: {\"n\":99}\nDATA: {\"n\":98}\ndat\ndata2: x\n\n\
                :data: {\"n\":97}\n\n\
                event: ping\n\n\
                data:\n\ndata: \n\ndata:   \r\n\r\n\
                data: {\"n\":3}\n\n";
    assert_eq!(sse(&["n"], body), (vec![Some(3)], Complete));
    // An empty stream, and one with only comments.
    assert_eq!(sse(&["n"], ""), (vec![None], Complete));
    assert_eq!(sse(&["n"], ": hi\n\n: there"), (vec![None], Complete));
}

#[test]
fn sse_long_non_data_lines_are_not_buffered() {
    let mut s = Scanner::new(&paths(&["n"]), BodyKind::EventStream);
    s.feed(b": ");
    for _ in 0..64 {
        s.feed(&[b'x'; 16 * 1024]);
    }
    s.feed(b"\nevent: ");
    s.feed(&vec![b'y'; 1 << 20]);
    s.feed(b"\ndata: {\"n\":5}\n\n");
    assert_eq!(s.finish(), Complete);
    assert_eq!(s.found(0), Some(5));
}

#[test]
fn sse_done_detection() {
    assert_eq!(sse(&["n"], "data: [DONE]\n\n").1, Complete);
    assert_eq!(sse(&["n"], "data:[DONE]\n\n").1, Complete);
    assert_eq!(sse(&["n"], "data: [DONE]").1, Complete);
    assert_eq!(sse(&["n"], "data: [DONE]x\n\n").1, Malformed);
    assert_eq!(sse(&["n"], "data: [DONE] \n\n").1, Malformed);
    assert_eq!(sse(&["n"], "data:  [DONE]\n\n").1, Malformed);
    assert_eq!(sse(&["n"], "data: [DON\n\n").1, Malformed);
    assert_eq!(sse(&["n"], "data: [done]\n\n").1, Malformed);
    assert_eq!(sse(&["n"], "data: [DONE]\ndata: [DONE]\n\n").1, Malformed);
    assert_eq!(sse(&["n"], "data: [DONE]\ndata\n\n").1, Malformed);
    // Cut inside the marker at the end of the stream: truncated.
    assert_eq!(sse(&["n"], "data: {\"n\":1}\n\ndata: [DO").1, Truncated);
    assert_eq!(sse(&["n"], "data: {\"n\":1}\n\ndata: [").1, Truncated);
}

#[test]
fn sse_bad_event_is_skipped_and_later_events_scanned() {
    let body = "data: {\"n\":5}\n\ndata: {\"n\":oops}\n\ndata: {\"n\":7}\n\n";
    assert_eq!(sse(&["n"], body), (vec![Some(7)], Malformed));
    // Values before the error in a bad event still count.
    let body = "data: {\"n\":50,]}\n\ndata: {\"n\":7}\n\n";
    assert_eq!(sse(&["n"], body), (vec![Some(50)], Malformed));
    // A terminated event with incomplete JSON is malformed; its values count.
    let body = "data: {\"n\":8\n\ndata: {\"n\":7}\n\n";
    assert_eq!(sse(&["n"], body), (vec![Some(8)], Malformed));
    // Two values in one event.
    assert_eq!(sse(&["n"], "data: {} {}\n\n").1, Malformed);
}

#[test]
fn sse_unterminated_final_event() {
    // Complete JSON without the blank line: counts, complete.
    assert_eq!(
        sse(&["n"], "data: {\"n\":1}\n\ndata: {\"n\":2}"),
        (vec![Some(2)], Complete)
    );
    assert_eq!(sse(&["n"], "data: {\"n\":2}\n"), (vec![Some(2)], Complete));
    // Incomplete JSON: truncated, the finished number still counts.
    assert_eq!(
        sse(&["n"], "data: {\"n\":1}\n\ndata: {\"n\":2"),
        (vec![Some(2)], Truncated)
    );
    assert_eq!(sse(&["n"], "data: {\"n\":2\n"), (vec![Some(2)], Truncated));
    assert_eq!(sse(&["n"], "data: {\"n\":\"2"), (vec![None], Truncated));
    // The line end after the last data line is not part of the data (a raw newline would be
    // malformed inside a string).
    assert_eq!(sse(&["n"], "data: {\"n\":\"2\nevent: x"), (vec![None], Truncated));
    assert_eq!(sse(&["n"], "data: {\"n\":\"2\r\n"), (vec![None], Truncated));
    // ... unless something earlier was malformed.
    assert_eq!(sse(&["n"], "data: x\n\ndata: {\"n\":2"), (vec![Some(2)], Malformed));
    // A final line that is not data does not make it truncated.
    assert_eq!(
        sse(&["n"], "data: {\"n\":2}\n\nevent: message_del"),
        (vec![Some(2)], Complete)
    );
    // `data` or `data:` at the very end: an empty data line.
    assert_eq!(sse(&["n"], "data: {\"n\":2}\ndata"), (vec![Some(2)], Complete));
    assert_eq!(sse(&["n"], "data: {\"n\":2}\ndata:"), (vec![Some(2)], Complete));
    // Malformed final event.
    assert_eq!(sse(&["n"], "data: {\"n\":2]"), (vec![Some(2)], Malformed));
}

#[test]
fn sse_paths_start_at_each_events_data() {
    let body = "data: {\"usage\":{\"total_tokens\":3}}\n\ndata: [{\"usage\":{\"total_tokens\":9}}]\n\n\
                data: {\"x\":{\"usage\":{\"total_tokens\":8}}}\n\n";
    assert_eq!(sse(&["usage.total_tokens"], body), (vec![Some(3)], Complete));
    // An event cut inside a key does not leak its depth into the next event.
    let body = "data: {\"a\":{\"usage\":{\"tot\n\ndata: {\"usage\":{\"total_tokens\":4}}\n\n";
    assert_eq!(
        sse(&["usage.total_tokens", "a.usage.total_tokens"], body),
        (vec![Some(4), None], Malformed)
    );
}

#[test]
fn sse_bom_at_start() {
    assert_eq!(sse(&["n"], "\u{FEFF}data: {\"n\":1}\n\n"), (vec![Some(1)], Complete));
    // A BOM later in the stream is part of a field name (ignored line).
    assert_eq!(sse(&["n"], "\n\u{FEFF}data: {\"n\":1}\n\n"), (vec![None], Complete));
    // A partial BOM makes the first line an ignored one.
    let body: &[u8] = b"\xEF\xBBdata: {\"n\":1}\ndata: {\"n\":2}\n\n";
    assert_eq!(
        check_splits(&["n"], BodyKind::EventStream, body),
        (vec![Some(2)], Complete)
    );
    assert_eq!(scan(&["n"], BodyKind::EventStream, b"\xEF\nda"), (vec![None], Complete));
    assert_eq!(scan(&["n"], BodyKind::EventStream, b"\xEF\xBB"), (vec![None], Complete));
}

// ---- Realistic bodies, split everywhere ----

const OPENAI_COMPLETION: &str = r#"{
  "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
  "object": "chat.completion",
  "created": 1741569952,
  "model": "gpt-4o-2024-08-06",
  "choices": [
{
  "index": 0,
  "message": {
    "role": "assistant",
    "content": "Hello! \"usage\": {\"total_tokens\": 999} \\ \u00e9\n How can I assist you today?",
    "refusal": null,
    "annotations": []
  },
  "logprobs": null,
  "finish_reason": "stop"
}
  ],
  "usage": {
"prompt_tokens": 19,
"completion_tokens": 10,
"total_tokens": 29,
"prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
"completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0}
  },
  "service_tier": "default"
}
"#;

const OPENAI_STREAM: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}],\"usage\":null}\n\n\
data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi \\\"there\\\" \\u00e9\"},\"finish_reason\":null}],\"usage\":null}\n\n\
data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n\
data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}\n\n\
data: [DONE]\n\n";

const ANTHROPIC_STREAM: &str = "event: message_start\n\
data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
event: content_block_start\n\
data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
event: ping\n\
data: {\"type\": \"ping\"}\n\n\
event: content_block_delta\n\
data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello \\ud83d\\ude00\"}}\n\n\
event: content_block_stop\n\
data: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
event: message_delta\n\
data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":15}}\n\n\
event: message_stop\n\
data: {\"type\":\"message_stop\"}\n\n";

const ESCAPES: &str = r#"{"us\u0061ge" : {"n\"q":1, "total_\u0074okens" : "4\u0030", "t\u00e9\ud83d\ude00":1.25e1},
 "x":["\\\"\/\b\f\n\r\t\u0000", {"usage":{"total_tokens":999}}], "usage":{"total_tokens":-3}}"#;

#[test]
fn splits_openai_completion() {
    let p = &[
        "usage.total_tokens",
        "usage.prompt_tokens",
        "usage.completion_tokens",
        "choices.message.content",
    ];
    let out = check_splits(p, BodyKind::Json, OPENAI_COMPLETION.as_bytes());
    assert_eq!(out, (vec![Some(29), Some(19), Some(10), None], Complete));
}

#[test]
fn splits_openai_stream() {
    let p = &["usage.total_tokens", "usage.prompt_tokens", "usage.completion_tokens"];
    let want = (vec![Some(21), Some(9), Some(12)], Complete);
    assert_eq!(check_splits(p, BodyKind::EventStream, OPENAI_STREAM.as_bytes()), want);
    let crlf = OPENAI_STREAM.replace('\n', "\r\n");
    assert_eq!(check_splits(p, BodyKind::EventStream, crlf.as_bytes()), want);
    let cr = OPENAI_STREAM.replace('\n', "\r");
    assert_eq!(check_splits(p, BodyKind::EventStream, cr.as_bytes()), want);
}

#[test]
fn splits_anthropic_stream() {
    let p = &[
        "message.usage.input_tokens",
        "usage.output_tokens",
        "message.usage.output_tokens",
        "index",
    ];
    let want = (vec![Some(25), Some(15), Some(1), Some(0)], Complete);
    assert_eq!(
        check_splits(p, BodyKind::EventStream, ANTHROPIC_STREAM.as_bytes()),
        want
    );
    let crlf = ANTHROPIC_STREAM.replace('\n', "\r\n");
    assert_eq!(check_splits(p, BodyKind::EventStream, crlf.as_bytes()), want);
    // Cut off before message_delta's blank line.
    let cut = &ANTHROPIC_STREAM[..ANTHROPIC_STREAM.find("\"output_tokens\":15").unwrap() + 18];
    let want = (vec![Some(25), Some(15), Some(1), Some(0)], Truncated);
    assert_eq!(check_splits(p, BodyKind::EventStream, cut.as_bytes()), want);
}

#[test]
fn splits_escapes() {
    let p = &["usage.total_tokens", "usage.n\"q", "usage.té😀", "x"];
    let want = (vec![Some(40), Some(1), Some(13), None], Complete);
    assert_eq!(check_splits(p, BodyKind::Json, ESCAPES.as_bytes()), want);
    let as_sse = format!("data: {}\n\n", ESCAPES.replace('\n', "\ndata: "));
    assert_eq!(check_splits(p, BodyKind::EventStream, as_sse.as_bytes()), want);
}

#[test]
fn splits_malformed_and_truncated() {
    for body in [
        &OPENAI_COMPLETION[..OPENAI_COMPLETION.len() / 2],
        &OPENAI_COMPLETION[..OPENAI_COMPLETION.find("29").unwrap() + 2],
        r#"{"usage":{"total_tokens":12"#,
        r#"{"usage":{"total_tokens":12}} {"#,
        r#"{"usage":{"total_tokens":"\uD83D\u00"#,
    ] {
        let one = scan(&["usage.total_tokens"], BodyKind::Json, body.as_bytes());
        assert_eq!(
            check_splits(&["usage.total_tokens"], BodyKind::Json, body.as_bytes()),
            one
        );
    }
}

// ---- Large bodies ----

/// About `size` bytes: a long string with escapes, a long array of objects and numbers,
/// then the usage.
fn big_body(size: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(size + 1024);
    body.extend_from_slice(br#"{"id":"chatcmpl-x","choices":[{"message":{"content":""#);
    while body.len() < size / 2 {
        body.extend_from_slice(br#"Lorem ipsum \"usage\":{\"total_tokens\":1} dolor \u00e9\n sit amet, "#);
    }
    body.extend_from_slice(br#""}}],"data":["#);
    let mut n = 0u64;
    while body.len() < size {
        body.extend_from_slice(format!(r#"{{"usage":{{"total_tokens":{n}}},"v":[0.125,-3e5,{n}]}},"#).as_bytes());
        n += 1;
    }
    body.extend_from_slice(br#"0],"usage":{"prompt_tokens":1000,"total_tokens":123456}}"#);
    body
}

#[test]
fn ten_megabyte_body() {
    let body = big_body(10 << 20);
    let p = &["usage.total_tokens", "usage.prompt_tokens"];
    let want = (vec![Some(123456), Some(1000)], Complete);
    assert_eq!(scan(p, BodyKind::Json, &body), want);
    // In uneven chunks.
    let chunks = body.chunks(8191);
    assert_eq!(scan_chunks(p, BodyKind::Json, chunks), want);
}

// ---- Fuzzing ----

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut XorShift, body: &[u8]) -> Vec<u8> {
    const INTERESTING: &[u8] = b"{}[]\":,\\u0123456789-+.eE tfnrl\r\n\x00\xEF\xBB\xBFdata: [DONE]";
    let mut out = body.to_vec();
    for _ in 0..=rng.below(4) {
        let at = rng.below(out.len() + 1);
        match rng.below(7) {
            0 if at < out.len() => out[at] = rng.next() as u8,
            1 if at < out.len() => out[at] = INTERESTING[rng.below(INTERESTING.len())],
            2 => out.insert(at, INTERESTING[rng.below(INTERESTING.len())]),
            3 if at < out.len() => {
                out.remove(at);
            }
            4 => out.truncate(at),
            5 => {
                let from = rng.below(out.len() + 1);
                let len = rng.below(out.len() - from + 1).min(64);
                let piece = out[from..from + len].to_vec();
                out.splice(at..at, piece);
            }
            _ => {}
        }
    }
    out
}

fn random_chunks<'a>(rng: &mut XorShift, body: &'a [u8]) -> Vec<&'a [u8]> {
    let mut chunks = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (a, b) = rest.split_at(rng.below(rest.len().min(32)) + 1);
        chunks.push(a);
        rest = b;
    }
    chunks
}

#[test]
fn fuzz_no_panic_and_split_invariance() {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let p = &[
        "usage.total_tokens",
        "usage.prompt_tokens",
        "message.usage.input_tokens",
        "usage.output_tokens",
        "n",
    ];
    let seeds: Vec<(&[u8], BodyKind)> = vec![
        (OPENAI_COMPLETION.as_bytes(), BodyKind::Json),
        (ESCAPES.as_bytes(), BodyKind::Json),
        (
            br#"{"n":[1,-2.5e3,{"n":"7"}],"n":true,"usage":{"total_tokens":12}}"#,
            BodyKind::Json,
        ),
        (OPENAI_STREAM.as_bytes(), BodyKind::EventStream),
        (ANTHROPIC_STREAM.as_bytes(), BodyKind::EventStream),
        (b"data: {\"n\":1}\r\n\r\ndata:[DONE]\r\r: c\n", BodyKind::EventStream),
    ];
    for round in 0..6000 {
        let (seed, kind) = seeds[round % seeds.len()];
        let body = if round % 10 == 9 {
            (0..rng.below(200)).map(|_| rng.next() as u8).collect()
        } else {
            mutate(&mut rng, seed)
        };
        let kind = if round % 7 == 0 { BodyKind::EventStream } else { kind };
        let whole = scan(p, kind, &body);
        let chunks = random_chunks(&mut rng, &body);
        assert_eq!(
            scan_chunks(p, kind, chunks),
            whole,
            "{:?}",
            String::from_utf8_lossy(&body)
        );
        let expected = match kind {
            BodyKind::Json => reference(p, &body),
            BodyKind::EventStream => reference_sse(p, &body),
        };
        assert_eq!(expected, whole, "{kind:?} {:?}", String::from_utf8_lossy(&body));
    }
}

#[test]
fn fuzz_deep_nesting() {
    // Beyond 64 levels the scan is lenient about closers, so it may accept what the strict
    // reference rejects; it must never reject what the reference accepts.
    let mut rng = XorShift(0x2545_F491_4F6C_DD1D);
    let p = &["k", "k.k", "n"];
    let seeds = [deep_body(70, true), deep_body(90, false)];
    for round in 0..1500 {
        let body = mutate(&mut rng, seeds[round % 2].as_bytes());
        let whole = scan(p, BodyKind::Json, &body);
        let chunks = random_chunks(&mut rng, &body);
        assert_eq!(scan_chunks(p, BodyKind::Json, chunks), whole);
        let expected = reference(p, &body);
        if expected.1 == Complete {
            assert_eq!(whole, expected, "{:?}", String::from_utf8_lossy(&body));
        }
        if whole.1 == Malformed {
            assert_eq!(expected.1, Malformed, "{:?}", String::from_utf8_lossy(&body));
        }
    }
}

// ---- A reference implementation for the differential fuzz test ----

/// Where a recursive-descent parse stopped.
#[derive(Debug)]
enum RefErr {
    Eof,
    Bad,
}

struct Ref<'a> {
    s: &'a [u8],
    pos: usize,
    paths: Vec<JsonPath>,
    found: Vec<Option<u64>>,
    /// The chain of enclosing containers: `Some(key)` for an object member, `None` for an
    /// array element.
    chain: Vec<Option<Vec<u8>>>,
}

/// Scans a whole JSON body with a recursive-descent parser.
fn reference(list: &[&str], body: &[u8]) -> Outcome {
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    reference_value(list, body)
}

/// Scans a whole event stream: splits it into lines and events, then parses each event's
/// data with [`reference_value`].
fn reference_sse(list: &[&str], body: &[u8]) -> Outcome {
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let mut lines: Vec<&[u8]> = Vec::new();
    let mut rest = body;
    while let Some(end) = rest.iter().position(|&b| b == b'\r' || b == b'\n') {
        lines.push(&rest[..end]);
        let skip = if rest[end..].starts_with(b"\r\n") { 2 } else { 1 };
        rest = &rest[end + skip..];
    }
    if !rest.is_empty() {
        lines.push(rest);
    }
    let mut found = vec![None; list.len()];
    let mut malformed = false;
    let mut data: Vec<u8> = Vec::new();
    let mut data_lines = 0;
    let close = |data: &mut Vec<u8>, data_lines: &mut usize, found: &mut Vec<Option<u64>>| {
        let lines = std::mem::take(data_lines);
        let d = std::mem::take(data);
        if lines == 0 || lines == 1 && d == b"[DONE]" || d.iter().all(|&b| is_ws(b)) {
            return None;
        }
        let (f, c) = reference_value(list, &d);
        for (a, b) in found.iter_mut().zip(f) {
            *a = (*a).max(b);
        }
        // A single data line cut inside `[DONE]`.
        let done_prefix = lines == 1 && d.len() < 6 && b"[DONE]".starts_with(&d);
        Some((c, done_prefix))
    };
    for line in lines {
        if line.is_empty() {
            if close(&mut data, &mut data_lines, &mut found).is_some_and(|(c, _)| c != Complete) {
                malformed = true;
            }
            continue;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &line[..0]),
        };
        if name == b"data" {
            if data_lines > 0 {
                data.push(b'\n');
            }
            data.extend_from_slice(value);
            data_lines += 1;
        }
    }
    let last = close(&mut data, &mut data_lines, &mut found);
    let c = match last {
        _ if malformed => Malformed,
        Some((Malformed, true)) => Truncated,
        Some((c, _)) => c,
        None => Complete,
    };
    (found, c)
}

/// Parses one JSON value (no byte-order mark).
fn reference_value(list: &[&str], body: &[u8]) -> Outcome {
    let mut r = Ref {
        s: body,
        pos: 0,
        paths: paths(list),
        found: vec![None; list.len()],
        chain: Vec::new(),
    };
    let c = match r.top() {
        Ok(()) => Complete,
        Err(RefErr::Eof) => Truncated,
        Err(RefErr::Bad) => Malformed,
    };
    (r.found, c)
}

impl Ref<'_> {
    fn peek(&self) -> Result<u8, RefErr> {
        self.s.get(self.pos).copied().ok_or(RefErr::Eof)
    }

    fn ws(&mut self) {
        while self.s.get(self.pos).is_some_and(|&b| is_ws(b)) {
            self.pos += 1;
        }
    }

    fn top(&mut self) -> Result<(), RefErr> {
        self.ws();
        self.value()?;
        self.ws();
        if self.pos < self.s.len() {
            return Err(RefErr::Bad);
        }
        Ok(())
    }

    fn record(&mut self, v: Option<u64>) {
        let Some(v) = v else { return };
        for (p, f) in self.paths.iter().zip(self.found.iter_mut()) {
            let same = p.segments.len() == self.chain.len()
                && p.segments
                    .iter()
                    .zip(&self.chain)
                    .all(|(s, k)| k.as_deref() == Some(s.as_bytes()));
            if same {
                *f = Some(f.map_or(v, |o| o.max(v)));
            }
        }
    }

    fn value(&mut self) -> Result<(), RefErr> {
        match self.peek()? {
            b'{' => {
                self.pos += 1;
                self.ws();
                if self.peek()? == b'}' {
                    self.pos += 1;
                    return Ok(());
                }
                loop {
                    self.ws();
                    if self.peek()? != b'"' {
                        return Err(RefErr::Bad);
                    }
                    let key = self.string()?;
                    self.ws();
                    if self.peek()? != b':' {
                        return Err(RefErr::Bad);
                    }
                    self.pos += 1;
                    self.ws();
                    self.chain.push(Some(key));
                    self.value()?;
                    self.chain.pop();
                    self.ws();
                    match self.peek()? {
                        b',' => self.pos += 1,
                        b'}' => {
                            self.pos += 1;
                            return Ok(());
                        }
                        _ => return Err(RefErr::Bad),
                    }
                }
            }
            b'[' => {
                self.pos += 1;
                self.ws();
                if self.peek()? == b']' {
                    self.pos += 1;
                    return Ok(());
                }
                loop {
                    self.ws();
                    self.chain.push(None);
                    self.value()?;
                    self.chain.pop();
                    self.ws();
                    match self.peek()? {
                        b',' => self.pos += 1,
                        b']' => {
                            self.pos += 1;
                            return Ok(());
                        }
                        _ => return Err(RefErr::Bad),
                    }
                }
            }
            b'"' => {
                let s = self.string()?;
                let v = if s.len() > MAX_VALUE_LEN {
                    Some(u64::MAX)
                } else {
                    usable_number(&s)
                };
                self.record(v);
                Ok(())
            }
            b'-' | b'0'..=b'9' => {
                let start = self.pos;
                self.number()?;
                let text = &self.s[start..self.pos];
                let v = if text.len() > MAX_VALUE_LEN {
                    Some(u64::MAX)
                } else {
                    usable_number(text)
                };
                self.record(v);
                Ok(())
            }
            _ => {
                for lit in LITERALS {
                    if self.s[self.pos..].starts_with(lit) {
                        self.pos += lit.len();
                        return Ok(());
                    }
                    if lit.starts_with(&self.s[self.pos..]) {
                        return Err(RefErr::Eof);
                    }
                }
                Err(RefErr::Bad)
            }
        }
    }

    fn digits(&mut self) -> usize {
        let n = self.s[self.pos..].iter().take_while(|b| b.is_ascii_digit()).count();
        self.pos += n;
        n
    }

    /// A number; at the end of input it is complete if it could end there.
    fn number(&mut self) -> Result<(), RefErr> {
        if self.peek()? == b'-' {
            self.pos += 1;
        }
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return Err(RefErr::Bad),
        }
        if self.s.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(if self.pos == self.s.len() {
                    RefErr::Eof
                } else {
                    RefErr::Bad
                });
            }
        }
        if matches!(self.s.get(self.pos), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.s.get(self.pos), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(if self.pos == self.s.len() {
                    RefErr::Eof
                } else {
                    RefErr::Bad
                });
            }
        }
        Ok(())
    }

    /// A string, unescaped (unpaired surrogates become U+FFFD).
    fn string(&mut self) -> Result<Vec<u8>, RefErr> {
        self.pos += 1;
        let mut out = Vec::new();
        let mut units: Vec<u16> = Vec::new();
        let flush = |units: &mut Vec<u16>, out: &mut Vec<u8>| {
            let s: String = char::decode_utf16(units.drain(..))
                .map(|r| r.unwrap_or(char::REPLACEMENT_CHARACTER))
                .collect();
            out.extend_from_slice(s.as_bytes());
        };
        loop {
            let b = self.peek()?;
            self.pos += 1;
            match b {
                b'"' => {
                    flush(&mut units, &mut out);
                    return Ok(out);
                }
                0..=0x1F => return Err(RefErr::Bad),
                b'\\' => {
                    let e = self.peek()?;
                    self.pos += 1;
                    let simple = match e {
                        b'"' | b'\\' | b'/' => e,
                        b'b' => 8,
                        b'f' => 12,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'u' => {
                            let mut unit = 0u16;
                            for _ in 0..4 {
                                let h = self.peek()?;
                                self.pos += 1;
                                let d = (h as char).to_digit(16).ok_or(RefErr::Bad)?;
                                unit = unit * 16 + d as u16;
                            }
                            units.push(unit);
                            continue;
                        }
                        _ => return Err(RefErr::Bad),
                    };
                    flush(&mut units, &mut out);
                    out.push(simple);
                }
                _ => {
                    flush(&mut units, &mut out);
                    out.push(b);
                }
            }
        }
    }
}

#[test]
fn reference_agrees_on_fixed_cases() {
    let p = &["usage.total_tokens", "n"];
    for body in [
        OPENAI_COMPLETION,
        ESCAPES,
        r#"{"n":1,"n":[2],"n":{"n":3}}"#,
        r#"{"n":12"#,
        r#"{"n":"12"#,
        r#"{"n":12.}"#,
        "",
        "nul",
    ] {
        assert_eq!(reference(p, body.as_bytes()), json(p, body), "{body}");
    }
}

// ---- Throughput (run with `cargo test --release -- --ignored --nocapture`) ----

#[test]
#[ignore = "timing; run in release"]
fn throughput() {
    fn measure(name: &str, kind: BodyKind, body: &[u8]) {
        let p = paths(&[
            "usage.total_tokens",
            "usage.prompt_tokens",
            "message.usage.input_tokens",
        ]);
        let mut best = f64::MAX;
        for _ in 0..20 {
            let start = std::time::Instant::now();
            let mut s = Scanner::new(&p, kind);
            for chunk in body.chunks(16 * 1024) {
                s.feed(chunk);
            }
            let c = s.finish();
            let secs = start.elapsed().as_secs_f64();
            assert_ne!(c, Malformed, "{name}");
            best = best.min(secs);
        }
        println!(
            "{name:<28} {:>6.1} MB  {:>8.0} MB/s",
            body.len() as f64 / 1e6,
            body.len() as f64 / 1e6 / best
        );
    }
    let size = 10 << 20;
    measure("mixed (big_body)", BodyKind::Json, &big_body(size));

    let mut text = br#"{"choices":[{"message":{"content":""#.to_vec();
    while text.len() < size {
        text.extend_from_slice(b"The quick brown fox jumps over the lazy dog, \\\"quoted\\\" \\u00e9.\\n ");
    }
    text.extend_from_slice(br#""}}],"usage":{"total_tokens":1}}"#);
    measure("string-heavy completion", BodyKind::Json, &text);

    let mut emb = br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":["#.to_vec();
    let mut x = 1u64;
    while emb.len() < size {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        emb.extend_from_slice(format!("{:.9},", (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5).as_bytes());
    }
    emb.extend_from_slice(br#"0]}],"usage":{"prompt_tokens":8,"total_tokens":8}}"#);
    measure("number-heavy embeddings", BodyKind::Json, &emb);

    let mut objs = br#"{"items":["#.to_vec();
    while objs.len() < size {
        objs.extend_from_slice(br#"{"id":12345,"name":"item","tags":["a","b"],"usage":{"total_tokens":3,"x":null}},"#);
    }
    objs.extend_from_slice(br#"{}],"usage":{"total_tokens":1}}"#);
    measure("small objects", BodyKind::Json, &objs);

    let mut pretty = Vec::new();
    while pretty.len() < size {
        pretty.extend_from_slice(OPENAI_COMPLETION.as_bytes());
    }
    let pretty = format!(
        "[{}]",
        String::from_utf8_lossy(&pretty).trim_end().replace("}\n{", "},\n{")
    );
    measure("pretty-printed", BodyKind::Json, pretty.as_bytes());

    let mut stream = Vec::new();
    while stream.len() < size {
        stream.extend_from_slice(b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello there\"},\"finish_reason\":null}],\"usage\":null}\n\n");
    }
    stream.extend_from_slice(OPENAI_STREAM.as_bytes());
    measure("event stream", BodyKind::EventStream, &stream);
    measure(
        "anthropic stream",
        BodyKind::EventStream,
        ANTHROPIC_STREAM.repeat(size / ANTHROPIC_STREAM.len()).as_bytes(),
    );
}
