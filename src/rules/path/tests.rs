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
fn keeps_reserved_escapes_and_cannot_escape_root() {
    assert_eq!(normalize("/a%2fb"), "/a%2Fb");
    assert_eq!(normalize("/../../etc"), "/etc");
    assert_eq!(normalize("/"), "/");
    assert_eq!(normalize(""), "/");
    assert_eq!(normalize("/%"), "/%25");
    assert_eq!(normalize("/a%4"), "/a%254");
    assert_eq!(normalize("/%%361"), "/%2561");
    assert_eq!(normalize("/ü/%C3%BC"), "/ü/%C3%BC");
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
