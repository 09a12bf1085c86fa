//! Calendar windows: days, weeks (starting Monday) and months of their real lengths, in UTC or
//! at a fixed UTC offset. A fixed or sliding window with `align: calendar` counts in these
//! instead of epoch-aligned multiples of its length. Mirrored by `tg_index` / `tg_start` in
//! `lua/common.lua`. Every other window keeps `index = now / window`, computed here too, so the
//! algorithms have one place that says where a window starts and ends.

use super::Quota;

/// A day in microseconds.
pub const DAY_US: u64 = 86_400_000_000;

/// The unit of a calendar window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    /// Midnight to midnight.
    Day,
    /// Monday 00:00 to Monday 00:00.
    Week,
    /// The 1st 00:00 to the next 1st 00:00 (28 to 31 days).
    Month,
}

impl CalendarUnit {
    /// The small integer the Lua script takes.
    pub fn code(self) -> u8 {
        match self {
            CalendarUnit::Day => 1,
            CalendarUnit::Week => 2,
            CalendarUnit::Month => 3,
        }
    }

    /// The window length written for it (a month's is nominal: 31 days, the longest).
    pub fn nominal_us(self) -> u64 {
        match self {
            CalendarUnit::Day => DAY_US,
            CalendarUnit::Week => 7 * DAY_US,
            CalendarUnit::Month => 31 * DAY_US,
        }
    }
}

/// Calendar alignment of a window: its unit and the UTC offset of the clock it follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Calendar {
    /// Day, week or month.
    pub unit: CalendarUnit,
    /// Seconds east of UTC (`+02:00` is 7200), within ±18 h.
    pub offset_s: i32,
}

impl CalendarUnit {
    /// The unit of a calendar window as written: `1d`, `1w` or `1mo` (also `1day`, `1week`,
    /// `1month`).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim() {
            "1d" | "1day" => CalendarUnit::Day,
            "1w" | "1week" => CalendarUnit::Week,
            "1mo" | "1month" => CalendarUnit::Month,
            _ => return None,
        })
    }
}

/// Largest UTC offset a calendar window may follow: 18 hours (as RFC 3339 allows).
pub const MAX_OFFSET_S: i32 = 18 * 3600;

/// A `timezone:` value as seconds east of UTC: `UTC`, `Z`, `+HH:MM` or `-HH:MM`.
pub fn parse_offset(s: &str) -> Option<i32> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("utc") || s == "Z" {
        return Some(0);
    }
    let (sign, rest) = match s.as_bytes().first()? {
        b'+' => (1, &s[1..]),
        b'-' => (-1, &s[1..]),
        _ => return None,
    };
    let (h, m) = rest.split_once(':')?;
    if h.len() != 2 || m.len() != 2 {
        return None;
    }
    let (h, m): (i32, i32) = (h.parse().ok()?, m.parse().ok()?);
    let off = sign * (h * 3600 + m * 60);
    (m < 60 && off.abs() <= MAX_OFFSET_S).then_some(off)
}

/// Days since 1970-01-01 of a civil date (proleptic Gregorian; H. Hinnant's algorithm).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date (year, month, day) of a day count since 1970-01-01.
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Monday 1970-01-05 is 4 days after the epoch (a Thursday): weeks count from there.
const WEEK_SHIFT_US: u64 = 3 * DAY_US;

/// The index of the window of `q` holding the instant `t` (µs since the epoch).
pub fn index(q: &Quota, t: u64) -> u64 {
    let Some(cal) = q.calendar else {
        return t / q.window_us.get();
    };
    let local = shift(t, cal.offset_s);
    match cal.unit {
        CalendarUnit::Day => local / DAY_US,
        CalendarUnit::Week => (local + WEEK_SHIFT_US) / (7 * DAY_US),
        CalendarUnit::Month => {
            let (y, m, _) = civil_from_days((local / DAY_US) as i64);
            (y as u64) * 12 + u64::from(m) - 1
        }
    }
}

/// The instant window `index` of `q` starts; window `index + 1` starts where it ends.
pub fn start(q: &Quota, index: u64) -> u64 {
    let Some(cal) = q.calendar else {
        return index.saturating_mul(q.window_us.get());
    };
    let local = match cal.unit {
        CalendarUnit::Day => index.saturating_mul(DAY_US),
        CalendarUnit::Week => index.saturating_mul(7 * DAY_US).saturating_sub(WEEK_SHIFT_US),
        CalendarUnit::Month => {
            let (y, m) = ((index / 12) as i64, (index % 12) as u32 + 1);
            (days_from_civil(y, m, 1).max(0) as u64).saturating_mul(DAY_US)
        }
    };
    shift(local, -cal.offset_s)
}

/// `t` moved by `offset_s` seconds (to local time, or back with the negated offset), saturating.
fn shift(t: u64, offset_s: i32) -> u64 {
    let off = i64::from(offset_s) * 1_000_000;
    if off >= 0 {
        t.saturating_add(off as u64)
    } else {
        t.saturating_sub(off.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;

    fn month(offset_s: i32) -> Quota {
        let mut q = Quota::window(
            super::super::Algorithm::FixedWindow,
            NonZeroU64::new(10).unwrap(),                               // allow-panic: test
            NonZeroU64::new(CalendarUnit::Month.nominal_us()).unwrap(), // allow-panic: test
        );
        q.calendar = Some(Calendar {
            unit: CalendarUnit::Month,
            offset_s,
        });
        q
    }

    fn at(y: i64, m: u32, d: u32, h: u64) -> u64 {
        days_from_civil(y, m, d) as u64 * DAY_US + h * 3_600_000_000
    }

    #[test]
    fn civil_dates_round_trip() {
        for z in [0i64, 59, 60, 365, 10_957, 11_016, 19_782, 20_000, 47_482] {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(
            days_from_civil(2000, 3, 1) - days_from_civil(2000, 2, 1),
            29,
            "2000 is a leap year"
        );
    }

    #[test]
    fn months_have_their_real_lengths() {
        let q = month(0);
        for (y, m, days) in [
            (2027, 2, 28),
            (2028, 2, 29),
            (2026, 4, 30),
            (2026, 12, 31),
            (2100, 2, 28),
        ] {
            let i = index(&q, at(y, m, 15, 12));
            assert_eq!(start(&q, i), at(y, m, 1, 0), "{y}-{m}");
            assert_eq!((start(&q, i + 1) - start(&q, i)) / DAY_US, days, "{y}-{m}");
        }
        // The last microsecond of February 2028 is in February; the next one in March.
        let mar = at(2028, 3, 1, 0);
        assert_ne!(index(&q, mar - 1), index(&q, mar));
    }

    #[test]
    fn an_offset_moves_the_boundary() {
        // At +02:00, a month starts at 22:00 UTC on the last day of the previous month.
        let q = month(7200);
        let i = index(&q, at(2026, 12, 10, 0));
        assert_eq!(start(&q, i), at(2026, 11, 30, 22));
        assert_eq!(index(&q, at(2026, 11, 30, 21)), i - 1);
        // At -05:00, 03:00 UTC on the 1st is still the previous month locally.
        let q = month(-5 * 3600);
        assert_eq!(index(&q, at(2027, 1, 1, 3)), index(&q, at(2026, 12, 20, 0)));
    }

    #[test]
    fn weeks_start_on_monday() {
        let mut q = month(0);
        q.calendar = Some(Calendar {
            unit: CalendarUnit::Week,
            offset_s: 0,
        });
        // 2026-11-30 is a Monday.
        let i = index(&q, at(2026, 12, 3, 5));
        assert_eq!(start(&q, i), at(2026, 11, 30, 0));
        assert_eq!(start(&q, i + 1), at(2026, 12, 7, 0));
    }
}
