// Shared with this crate's build.rs (through `include!`), so plain comments
// only: no inner doc comments.

/// Days since 1970-01-01 to a civil date, `(year, month, day)`, in the
/// proleptic Gregorian calendar (Howard Hinnant's `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Seconds since the Unix epoch as RFC 3339 in UTC: `2026-12-01T07:30:00Z`.
pub fn utc_rfc3339(secs: i64) -> String {
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        t / 3_600,
        t % 3_600 / 60,
        t % 60
    )
}

/// A duration in ms as a short text: `850ms`, `42s`, `5m12s`, `3h04m`, `2d03h`.
pub fn short_duration(ms: u64) -> String {
    let s = ms / 1_000;
    match s {
        0 => format!("{ms}ms"),
        1..60 => format!("{s}s"),
        60..3_600 => format!("{}m{:02}s", s / 60, s % 60),
        3_600..86_400 => format!("{}h{:02}m", s / 3_600, s % 3_600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3_600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_durations_read_as_expected() {
        assert_eq!(utc_rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_rfc3339(1_796_110_200), "2026-12-01T07:30:00Z");
        assert_eq!(short_duration(850), "850ms");
        assert_eq!(short_duration(312_000), "5m12s");
        assert_eq!(short_duration(11_040_000), "3h04m");
    }
}
