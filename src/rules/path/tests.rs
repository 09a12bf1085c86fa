use super::*;

#[test]
fn normalises_bypass_spellings() {
    for p in [
        "/api/v1/login",
        "/api/v1//login",
        "/api/v1/%6Cogin",
        "/api/v1/%6cogin",
        "/api/x/../v1/login",
        "/api/v1/./login",
        "/api/v1/login/",
        "/api/v1/login;jsessionid=1",
        "//api/v1/login//",
        "/api/v1/login/.",
    ] {
        assert_eq!(normalize(p), "/api/v1/login", "{p}");
    }
}

#[test]
fn keeps_reserved_escapes_as_data_and_cannot_escape_root() {
    assert_eq!(normalize("/a%2fb"), "/a%2Fb");
    assert_eq!(normalize("/a%5cb"), "/a%5Cb");
    assert_eq!(normalize("/../../etc"), "/etc");
    assert_eq!(normalize("/"), "/");
    assert_eq!(normalize(""), "/");
    assert_eq!(normalize("/%"), "/%25");
    assert_eq!(normalize("/a%4"), "/a%254");
    assert_eq!(normalize("/%%361"), "/%2561");
    assert_eq!(normalize("/ü/%C3%BC"), "/%C3%BC/%C3%BC");
    // Every escape is decoded; what must be escaped is escaped again, upper case.
    assert_eq!(normalize("/a%2Cb%3a%40"), "/a,b:@");
    assert_eq!(normalize("/a%20b"), "/a%20b");
    assert_eq!(normalize("/a%3bb"), "/a%3Bb");
    assert_eq!(normalize("/%2e%2E/x"), "/x");
}

#[test]
fn normalize_is_a_fixed_point() {
    for p in [
        "/a%2fb", "/%%361", "/ü", "/a%00b", "/a\\b", "/x%3B", "/a./b%20", "/{id}",
    ] {
        let n = normalize(p).into_owned();
        assert_eq!(normalize(&n), n, "{p}");
    }
}

#[test]
fn canonical_refuses_what_an_upstream_reads_as_another_path() {
    let c = |p| canonical(p, EncodedSlashes::Reject);
    for (p, e) in [
        ("/api%2Fv1%2Flogin", PathError::EncodedSlash),
        ("/api/v1%2flogin", PathError::EncodedSlash),
        ("/api/v1%5clogin", PathError::EncodedSlash),
        ("/api\\v1\\login", PathError::Backslash),
        ("/api/v1/login%00", PathError::ControlByte),
        ("/api/v1/login%0a", PathError::ControlByte),
        ("/api/v1/login%3bx", PathError::EncodedSemicolon),
        ("/api/v1/login%20", PathError::TrailingDotOrSpace),
        ("/api/v1/login%09", PathError::ControlByte),
        ("/api/v1/login.", PathError::TrailingDotOrSpace),
        ("/api/v1/login%2e", PathError::TrailingDotOrSpace),
        ("/api/v1/lo%zzgin", PathError::MalformedEscape),
        ("*", PathError::NotOriginForm),
        ("", PathError::NotOriginForm),
    ] {
        assert_eq!(c(p), Err(e), "{p}");
    }
    // Dot-segments are structure, not a trailing dot.
    assert_eq!(c("/api/./v1/x/../login").as_deref(), Ok("/api/v1/login"));
    assert_eq!(c("/api/v1/log%69n").as_deref(), Ok("/api/v1/login"));
    assert_eq!(c("/api//v1/login;jsessionid=1").as_deref(), Ok("/api/v1/login"));
    // A trailing slash is kept for the upstream (it may redirect `/a` to `/a/`); the rules
    // read both as one path.
    assert_eq!(c("/api/v1/login/").as_deref(), Ok("/api/v1/login/"));
    assert_eq!(normalize("/api/v1/login/"), "/api/v1/login");
    assert!(matches!(c("/api/v1/login"), Ok(std::borrow::Cow::Borrowed(_))));
    assert!(matches!(c("/a/b-c_d~e/f.json"), Ok(std::borrow::Cow::Borrowed(_))));
    // With `encoded_slashes: keep` they are data, matched and forwarded encoded.
    assert_eq!(
        canonical("/files/a%2fb", EncodedSlashes::Keep).as_deref(),
        Ok("/files/a%2Fb")
    );
    assert_eq!(
        canonical("/files/a\\b", EncodedSlashes::Keep),
        Err(PathError::Backslash)
    );
}

#[test]
fn what_is_forwarded_is_what_is_matched() {
    for p in [
        "/api/v1/login",
        "/api/v1//login/",
        "/api/%76%31/./login",
        "/a%2Cb/%7Bx%7D/",
        "/x/../y;p=1/z",
        "/caf%c3%a9",
    ] {
        let forwarded = canonical(p, EncodedSlashes::Reject).unwrap().into_owned();
        assert_eq!(normalize(&forwarded), normalize(p), "{p}");
        assert_eq!(canonical(&forwarded, EncodedSlashes::Reject).unwrap(), forwarded, "{p}");
    }
}

#[test]
fn patterns_match() {
    let p = Pattern::parse("/users/{id}").unwrap();
    assert!(p.matches("/users/42"));
    assert!(!p.matches("/users"));
    assert!(!p.matches("/users/42/x"));
    let p = Pattern::parse("/a/**").unwrap();
    assert!(p.matches("/a"));
    assert!(p.matches("/a/b/c"));
    assert!(!p.matches("/ab"));
    let p = Pattern::parse("/**").unwrap();
    assert!(p.matches("/"));
    assert!(p.matches("/x/y"));
    assert!(Pattern::parse("/a/**/b").is_err());
    assert!(Pattern::parse("a").is_err());
    assert!(Pattern::parse("/a/x*").is_err());
}
