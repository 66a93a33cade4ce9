use megamoe::formats::{e2m1, e4m3, ue8m0};
#[test]
fn roundtrip_all_codes() {
    for c in 0u8..=255 {
        let v = e4m3::decode(c);
        if v.is_nan() {
            continue;
        }
        let back = e4m3::encode_rne(v);
        assert_eq!(e4m3::decode(back), v, "code {c:#x}");
    }
    for c in 0u8..16 {
        assert_eq!(e2m1::encode_rne(e2m1::decode(c)), c);
    }
    for c in 1u8..255 {
        assert_eq!(ue8m0::encode_exact(ue8m0::decode(c)), Some(c));
    }
}
