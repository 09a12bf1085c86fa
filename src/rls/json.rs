//! envoyproxy/ratelimit's `/json` body: a `RateLimitRequest` and its response in the proto3
//! JSON mapping (camelCase names, enum names, durations as `"59s"`, default values left out;
//! snake_case names are read too, as protojson reads them).

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::config::Unit;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct JRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JDescriptor>,
    #[serde(default, alias = "hits_addend")]
    hits_addend: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct JDescriptor {
    #[serde(default)]
    entries: Vec<JEntry>,
    #[serde(default)]
    limit: Option<JOverride>,
    #[serde(default, alias = "hits_addend")]
    hits_addend: Option<Value>,
    #[serde(default, alias = "is_negative_hits")]
    is_negative_hits: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JEntry {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct JOverride {
    #[serde(default, alias = "requests_per_unit")]
    requests_per_unit: u32,
    #[serde(default)]
    unit: Value,
}

/// A protojson integer: a number or a string of digits.
fn uint(v: &Value, what: &str) -> Result<u64, String> {
    match v {
        Value::Number(n) => n.as_u64().ok_or_else(|| format!("{what}: not an unsigned integer")),
        Value::String(s) => s.parse().map_err(|_| format!("{what}: not an unsigned integer")),
        _ => Err(format!("{what}: not an unsigned integer")),
    }
}

fn unit_of(v: &Value) -> Result<i32, String> {
    match v {
        Value::Null => Ok(0),
        Value::Number(n) => n
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .ok_or_else(|| "limit.unit: not a unit".to_string()),
        Value::String(s) => Unit::parse(s)
            .map(Unit::proto)
            .ok_or_else(|| format!("limit.unit: unknown unit {s:?}")),
        _ => Err("limit.unit: not a unit".to_string()),
    }
}

/// Parse a `/json` body.
pub fn request(body: &[u8]) -> Result<RateLimitRequest, String> {
    let j: JRequest = serde_json::from_slice(body).map_err(|e| format!("not a RateLimitRequest: {e}"))?;
    let hits_addend = match &j.hits_addend {
        Some(v) => {
            u32::try_from(uint(v, "hitsAddend")?).map_err(|_| "hitsAddend: larger than 4294967295".to_string())?
        }
        None => 0,
    };
    let mut descriptors = Vec::with_capacity(j.descriptors.len());
    for d in j.descriptors {
        let hits = match &d.hits_addend {
            Some(v) => Some(UInt64Value {
                value: uint(v, "descriptors[].hitsAddend")?,
            }),
            None => None,
        };
        let limit = match d.limit {
            Some(o) => Some(RateLimitOverride {
                requests_per_unit: o.requests_per_unit,
                unit: unit_of(&o.unit)?,
            }),
            None => None,
        };
        descriptors.push(RateLimitDescriptor {
            entries: d
                .entries
                .into_iter()
                .map(|e| Entry {
                    key: e.key,
                    value: e.value,
                })
                .collect(),
            limit,
            hits_addend: hits,
            is_negative_hits: d.is_negative_hits,
        });
    }
    Ok(RateLimitRequest {
        domain: j.domain,
        descriptors,
        hits_addend,
    })
}

fn code_name(c: i32) -> &'static str {
    match Code::try_from(c) {
        Ok(Code::Ok) => "OK",
        Ok(Code::OverLimit) => "OVER_LIMIT",
        _ => "UNKNOWN",
    }
}

fn unit_name(u: i32) -> &'static str {
    match Unit::from_proto(u) {
        Some(Unit::Second) => "SECOND",
        Some(Unit::Minute) => "MINUTE",
        Some(Unit::Hour) => "HOUR",
        Some(Unit::Day) => "DAY",
        Some(Unit::Week) => "WEEK",
        Some(Unit::Month) => "MONTH",
        Some(Unit::Year) => "YEAR",
        None => "UNKNOWN",
    }
}

/// The protojson of `r`.
pub fn response(r: &RateLimitResponse) -> String {
    let mut out = Map::new();
    out.insert("overallCode".into(), json!(code_name(r.overall_code)));
    let statuses: Vec<Value> = r
        .statuses
        .iter()
        .map(|s| {
            let mut m = Map::new();
            m.insert("code".into(), json!(code_name(s.code)));
            if let Some(l) = &s.current_limit {
                let mut lm = Map::new();
                if !l.name.is_empty() {
                    lm.insert("name".into(), json!(l.name));
                }
                if l.requests_per_unit != 0 {
                    lm.insert("requestsPerUnit".into(), json!(l.requests_per_unit));
                }
                lm.insert("unit".into(), json!(unit_name(l.unit)));
                m.insert("currentLimit".into(), Value::Object(lm));
            }
            if s.limit_remaining != 0 {
                m.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(d) = &s.duration_until_reset {
                m.insert("durationUntilReset".into(), json!(format!("{}s", d.seconds)));
            }
            Value::Object(m)
        })
        .collect();
    if !statuses.is_empty() {
        out.insert("statuses".into(), Value::Array(statuses));
    }
    if !r.response_headers_to_add.is_empty() {
        let hs: Vec<Value> = r
            .response_headers_to_add
            .iter()
            .map(|h| json!({"key": h.key, "value": h.value}))
            .collect();
        out.insert("responseHeadersToAdd".into(), Value::Array(hs));
    }
    Value::Object(out).to_string()
}
