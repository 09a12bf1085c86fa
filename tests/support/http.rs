//! The HTTP client side: one client per test, and helpers to read admin endpoints.

/// A plain HTTP client (no pooling surprises: one client per test).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap()
}

/// GET `url` and return the body as text (admin `/metrics`, for instance).
pub async fn get_text(c: &reqwest::Client, url: impl reqwest::IntoUrl) -> String {
    c.get(url).send().await.unwrap().text().await.unwrap()
}

/// GET `url` and parse the body as JSON (admin `/rules`, `/keys/…`, `/explain`).
pub async fn get_json(c: &reqwest::Client, url: impl reqwest::IntoUrl) -> serde_json::Value {
    c.get(url).send().await.unwrap().json().await.unwrap()
}

/// The value of the metric line starting with `name` (labels included), if present.
pub fn metric(body: &str, name: &str) -> Option<String> {
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .map(|l| l.rsplit(' ').next().unwrap_or("").to_string())
}

/// The value of metric `name` (labels included) on the admin listener `admin`, 0 when absent.
pub async fn metric_value(c: &reqwest::Client, admin: &str, name: &str) -> f64 {
    let body = get_text(c, format!("{admin}/metrics")).await;
    metric(&body, name).map_or(0.0, |v| v.parse().unwrap())
}
