//! Tests of the settle phase (`super`).

use super::body::{body_charge, BodyEnd, Charge};
use crate::metrics::Unreported;
use crate::usage::Completeness;

const WHOLE: BodyEnd = BodyEnd {
    ended: true,
    left: false,
    cut: false,
    encoded: false,
    completeness: Completeness::Complete,
};

fn charge(settle_to: Option<u64>, may_refund: bool, charged: u64, unreported: Option<Unreported>) -> Charge {
    Charge {
        settle_to,
        may_refund,
        charged,
        unreported,
    }
}

/// Every way a body can end, against a reservation of 300 (max 1000): only a whole, valid
/// body its client stayed for ever refunds; nothing charges less than it reserved otherwise.
#[test]
fn a_body_is_charged_as_documented() {
    // Whole and valid: the number, refund or debit.
    assert_eq!(
        body_charge(300, Some(27), (1000, false), WHOLE),
        charge(Some(27), true, 27, None)
    );
    assert_eq!(
        body_charge(300, Some(900), (1000, false), WHOLE),
        charge(Some(900), true, 900, None)
    );
    // Whole and valid without the number: the reservation stays.
    assert_eq!(
        body_charge(300, None, (1000, false), WHOLE),
        charge(None, false, 300, Some(Unreported::Absent))
    );
    // ... or `max` with `missing: max`, whether the client stayed or not.
    assert_eq!(
        body_charge(300, None, (1000, true), WHOLE),
        charge(Some(1000), false, 1000, Some(Unreported::Absent))
    );
    let left = BodyEnd { left: true, ..WHOLE };
    assert_eq!(
        body_charge(300, None, (1000, true), left),
        charge(Some(1000), false, 1000, Some(Unreported::Absent))
    );
    // Malformed or truncated: never below the reservation.
    for completeness in [Completeness::Malformed, Completeness::Truncated] {
        let end = BodyEnd { completeness, ..WHOLE };
        assert_eq!(
            body_charge(300, Some(12), (1000, false), end),
            charge(None, false, 300, Some(Unreported::Malformed))
        );
        assert_eq!(
            body_charge(300, Some(507), (1000, false), end),
            charge(Some(507), false, 507, Some(Unreported::Malformed))
        );
    }
    // Compressed, or the body failed.
    let encoded = BodyEnd { encoded: true, ..WHOLE };
    assert_eq!(
        body_charge(300, None, (1000, false), encoded),
        charge(None, false, 300, Some(Unreported::Encoded))
    );
    let failed = BodyEnd { ended: false, ..WHOLE };
    assert_eq!(
        body_charge(300, Some(40), (1000, false), failed),
        charge(None, false, 300, Some(Unreported::Failed))
    );
    // The client left: the reservation, or the report if larger; never a refund.
    let left = BodyEnd { left: true, ..WHOLE };
    assert_eq!(
        body_charge(300, Some(45), (1000, false), left),
        charge(None, false, 300, None)
    );
    assert_eq!(
        body_charge(300, Some(440), (1000, false), left),
        charge(Some(440), false, 440, None)
    );
    // ... and the rest never came in time: max.
    let cut = BodyEnd {
        left: true,
        cut: true,
        ended: false,
        ..WHOLE
    };
    assert_eq!(
        body_charge(300, Some(45), (1000, false), cut),
        charge(Some(1000), false, 1000, Some(Unreported::Cut))
    );
}
