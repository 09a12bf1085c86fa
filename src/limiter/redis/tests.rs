//! Unit tests for the pure parts of the Redis store (the script itself is tested against real
//! Redis servers in `tests/redis_store.rs` and `tests/differential.rs`).

use std::num::NonZeroU64;

use super::conn::connect_timeout;
use super::protocol::{
    check_cmd, checked, function_library, function_name, parse_packed, peeked, script_cmd, Invoke, Mode,
    SCRIPT_DEFINITIONS,
};
use super::slots::one_tag;
use super::*;
use redis::Value;

fn check(key: &str, algorithm: Algorithm, shadow: bool) -> LimitCheck {
    let n = |v| NonZeroU64::new(v).unwrap();
    LimitCheck {
        key: StoreKey::from(key.to_owned()),
        quota: if algorithm.is_bucket() {
            Quota::bucket(algorithm, n(10), n(100_000))
        } else {
            Quota::window(algorithm, n(10), n(1_000_000))
        },
        cost: 2,
        shadow,
        holder: 0,
        penalty: None,
        lease: None,
    }
}

fn args(cmd: &Cmd) -> Vec<String> {
    cmd.args_iter()
        .map(|a| match a {
            redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
            _ => "<other>".to_owned(),
        })
        .collect()
}

#[test]
fn script_is_all_fragments_in_order() {
    let order = [
        "shared helpers",
        "token bucket (algorithm code 1)",
        "leaky bucket (algorithm code 2)",
        "fixed window (algorithm code 3)",
        "sliding log (algorithm code 4)",
        "sliding window counter (algorithm code 5)",
        "entry point of the combined limit script",
    ];
    let mut at = 0;
    for marker in order {
        let pos = SCRIPT_SOURCE[at..]
            .find(marker)
            .unwrap_or_else(|| panic!("{marker} missing or out of order"));
        at += pos;
    }
    // No fragment may define a global: Redis 7 refuses them.
    for line in SCRIPT_SOURCE.lines() {
        assert!(!line.starts_with("function "), "global function: {line}");
    }
}

#[test]
fn sha_is_sha1_of_the_source() {
    let sha = redis::Script::new(SCRIPT_SOURCE).get_hash().to_owned();
    assert_eq!(sha.len(), 40);
    assert!(sha.bytes().all(|b| b.is_ascii_hexdigit()));
}

#[test]
fn evalsha_command_layout() {
    let cs = [
        check("tl:{a}:r1:1s", Algorithm::FixedWindow, false),
        check("tl:{a}:r2:b", Algorithm::LeakyBucket, true),
    ];
    let cmd = check_cmd(
        Invoke::EvalSha("abc"),
        Some(1_700_000_000_000_000),
        [(&cs[..], 0), (&cs[1..], 1_700_000_000_300_000)].into_iter(),
    );
    assert_eq!(
        args(&cmd),
        [
            "EVALSHA",
            "abc",
            "3",
            "tl:{a}:r1:1s",
            "tl:{a}:r2:b",
            "tl:{a}:r2:b",
            "check",
            "1700000000000000",
            "2",
            "2",
            "0",
            "3:10:1000000:2:0",
            "2:10:100000:2:1",
            "1",
            "1700000000300000",
            "2:10:100000:2:1",
        ]
    );
    let cmd = script_cmd(Invoke::Eval, Mode::Peek, None, cs[..1].iter());
    let a = args(&cmd);
    assert_eq!(a[0], "EVAL");
    assert_eq!(a[1], SCRIPT_SOURCE);
    assert_eq!(a[2..], ["1", "tl:{a}:r1:1s", "peek", "", "3:10:1000000:2:0"]);
}

#[test]
fn fcall_takes_the_same_keys_and_arguments_as_evalsha() {
    let cs = [
        check("tl:{a}:r1:1s", Algorithm::FixedWindow, false),
        check("tl:{a}:r2:b", Algorithm::LeakyBucket, true),
    ];
    let by = |how| {
        let cmd = check_cmd(how, None, [(&cs[..], 0), (&cs[1..], 0)].into_iter());
        args(&cmd)
    };
    let (fcall, evalsha) = (by(Invoke::Fcall("tollgate_abc")), by(Invoke::EvalSha("abc")));
    assert_eq!(fcall[..2], ["FCALL", "tollgate_abc"]);
    assert_eq!(fcall[2..], evalsha[2..]);
    let peek = script_cmd(Invoke::Fcall("f"), Mode::Peek, None, std::iter::empty());
    assert_eq!(args(&peek), ["FCALL", "f", "0", "peek", ""]);
}

#[test]
fn function_library_registers_the_scripts_definitions() {
    let sha = redis::Script::new(SCRIPT_SOURCE).get_hash().to_owned();
    let name = function_name(&sha);
    assert_eq!(name, format!("tollgate_{sha}"));
    assert!(
        name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
        "a valid library name"
    );
    let lib = function_library(&name);
    let (first, rest) = lib.split_once('\n').unwrap();
    assert_eq!(first, format!("#!lua name={name}"));
    // The EVAL script is the definitions and one call of tg_run; the library is the same
    // definitions and the registration of tg_run.
    let defs = SCRIPT_SOURCE
        .strip_prefix("local TG_EVAL_KEYS, TG_EVAL_ARGV = KEYS, ARGV\n")
        .and_then(|s| s.strip_suffix("\nreturn tg_run(TG_EVAL_KEYS, TG_EVAL_ARGV)\n"))
        .unwrap();
    assert_eq!(defs, SCRIPT_DEFINITIONS);
    assert_eq!(
        rest,
        format!("{defs}\nredis.register_function{{function_name='{name}', callback=tg_run}}\n")
    );
}

/// A packed reply as the script builds it.
fn packed(nums: &[f64]) -> Value {
    Value::BulkString(nums.iter().flat_map(|f| f.to_le_bytes()).collect())
}

#[test]
fn parse_packed_reads_doubles_and_rejects_bad_shapes() {
    let now = 1_796_025_623_586_863.0; // 16 digits: exact as a double
    let (t, outs) = parse_packed(
        packed(&[now, 1.0, 4.0, 1e6, 0.0, 0.0, 0.0, 0.0, 5e5, 5e5, 0.0]),
        2,
        checked,
    )
    .unwrap();
    assert_eq!(t, 1_796_025_623_586_863);
    assert!(outs.iter().all(|(late, _)| !late));
    let outs: Vec<Outcome> = outs.into_iter().map(|(_, o)| o).collect();
    assert_eq!(
        outs,
        [
            Outcome {
                allowed: true,
                remaining: 4,
                reset_us: 1_000_000,
                retry_after_us: 0,
                delay_us: 0,
                at_us: 1_796_025_623_586_863,
                ..Outcome::default()
            },
            Outcome {
                allowed: false,
                remaining: 0,
                reset_us: 500_000,
                retry_after_us: 500_000,
                delay_us: 0,
                at_us: 1_796_025_623_586_863,
                ..Outcome::default()
            }
        ]
    );
    // Out-of-range values (never sent) read as 0 rather than wrapping.
    let (_, outs) = parse_packed(packed(&[1.0, 1.0, -5.0, f64::NAN, 1e300, 0.0]), 1, checked).unwrap();
    assert_eq!(
        (outs[0].1.remaining, outs[0].1.reset_us, outs[0].1.retry_after_us),
        (0, 0, 0)
    );
    // A peek marks a missing key with allowed = 2.
    let (_, outs) = parse_packed(
        packed(&[7.0, 2.0, 0.0, 0.0, 0.0, 0.0, 1.0, 3.0, 9.0, 0.0, 0.0]),
        2,
        peeked,
    )
    .unwrap();
    assert_eq!(outs[0], None);
    assert_eq!(outs[1].map(|o| o.remaining), Some(3));
    // Wrong length, or not a bulk string.
    assert!(matches!(
        parse_packed(packed(&[1.0, 1.0]), 1, checked),
        Err(StoreError::Protocol(_))
    ));
    assert!(matches!(
        parse_packed(Value::Array(vec![Value::Int(1)]), 0, checked),
        Err(StoreError::Protocol(_))
    ));
}

#[test]
fn grouping_by_hash_tag() {
    let keys: Vec<StoreKey> = ["tl:{a}:x", "tl:{b}:x", "tl:{a}:y", "tl:{c}:z", "tl:{b}:w"]
        .iter()
        .map(|k| StoreKey::from((*k).to_owned()))
        .collect();
    assert_eq!(group_by_tag(keys.iter()), vec![vec![0, 2], vec![1, 4], vec![3]]);
    assert!(!one_tag(keys.iter()));
    assert!(one_tag(keys[..1].iter()));
    assert!(one_tag([keys[0].clone(), keys[2].clone()].iter()));
    assert!(one_tag(std::iter::empty()));
}

#[test]
fn connect_timeout_is_bounded() {
    assert_eq!(connect_timeout(Duration::from_millis(20)), Duration::from_millis(100));
    assert_eq!(connect_timeout(Duration::from_millis(100)), Duration::from_millis(400));
    assert_eq!(connect_timeout(Duration::from_secs(5)), Duration::from_secs(1));
}
