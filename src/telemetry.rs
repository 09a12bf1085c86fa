//! Span export over OTLP/HTTP (protobuf), off unless `tracing.otlp` is configured.
//!
//! One span per request, kind `SERVER`, with the request's W3C trace context
//! (`crate::http::trace`): its trace id, tollgate's span id (the parent the upstream was sent),
//! the incoming parent as its parent. It starts when the request reached the request path and
//! ends when its access line would be written (`crate::proxy::access`): the response body's
//! end, or the client leaving (status 499, `tollgate.client_aborted`).
//!
//! Which requests are exported: every denial (429), every request that failed open, every 5xx
//! and local error, every aborted request; allowed requests at `sample_ratio`, decided on the
//! trace id (so every gateway of a fleet keeps the same traces), or — with `parent_based` —
//! by the incoming `traceparent`'s sampled flag when there is one. A trace started here that
//! the ratio picks goes upstream with its sampled flag set.
//!
//! The request path does no OpenTelemetry work: it hands a [`Finished`] record to a bounded
//! queue (`try_send`: a full queue drops the span and counts it in
//! `tollgate_otlp_spans_total{result="dropped"}`, never waits). The thread `tollgate-otlp`
//! turns records into the SDK's [`SpanData`], batches them (up to [`MAX_BATCH`], or what came
//! in [`FLUSH_EVERY`]) and exports each batch with `opentelemetry-otlp`'s exporter, whose
//! HTTP requests run on a one-thread runtime of their own ([`Transport`]).
//!
//! tollgate's own background work (rules reloads) is exported too, through
//! `tracing-opentelemetry`: [`ops_layer`] turns the `tracing` span `tollgate.reload` and the
//! events logged inside it into an OTLP span with span events.

use std::borrow::Cow;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter, SpanLinks};

use crate::config::otlp::OtlpConfig;
use crate::http::trace::TraceContext;
use crate::metrics::OtlpCounters;

/// Most spans in one export request.
pub const MAX_BATCH: usize = 512;
/// A batch that is not full is exported this long after its first span.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// The binding limit of a request: the one whose headers it got, or that denied it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindingLimit {
    /// Units per window (or bucket capacity).
    pub limit: u64,
    /// The window, milliseconds.
    pub window_ms: u64,
    /// Units left after this request.
    pub remaining: u64,
}

/// One finished request, as the request path hands it over.
#[derive(Debug)]
pub struct Finished {
    /// Its trace context.
    pub trace: TraceContext,
    /// When it reached the request path.
    pub start: SystemTime,
    /// When its access line would be written.
    pub end: SystemTime,
    /// Its method.
    pub method: http::Method,
    /// Its path, without the query.
    pub path: String,
    /// The status the client got (499: it left first).
    pub status: u16,
    /// The access line's decision (`allowed`, `limited`, `fail_open`, ...).
    pub decision: &'static str,
    /// The rule that bound or denied.
    pub rule: Option<Arc<str>>,
    /// That rule's limit.
    pub binding: Option<BindingLimit>,
    /// Some rule let it through unchecked because its store was down.
    pub fail_open: bool,
    /// Time waiting for the store, microseconds (`None`: decided locally).
    pub store_us: Option<u64>,
    /// The upstream target that answered (or was last tried).
    pub target: Option<Arc<str>>,
    /// Upstream attempts.
    pub attempts: u8,
    /// Time waiting for the upstream's response head, microseconds.
    pub upstream_us: u64,
    /// The client left before the end of the response.
    pub client_aborted: bool,
}

/// The exporter's handle on the request path.
#[derive(Debug)]
pub struct Exporter {
    /// Into the export thread.
    tx: SyncSender<Finished>,
    /// Which allowed requests are exported.
    sampling: Sampling,
    /// Dropped spans are counted here.
    dropped: prometheus_client::metrics::counter::Counter,
}

impl Exporter {
    /// Start exporting to `cfg.endpoint`: the transport's runtime and the export thread.
    pub fn start(cfg: &OtlpConfig, counters: &OtlpCounters) -> Result<Arc<Exporter>, String> {
        let transport = Transport::start(cfg.timeout)?;
        let mut exporter = span_exporter(cfg, transport.clone())?;
        exporter.set_resource(&resource(cfg));
        let (tx, rx) = std::sync::mpsc::sync_channel(cfg.queue_size);
        let c = counters.clone();
        std::thread::Builder::new()
            .name("tollgate-otlp".into())
            .spawn(move || export_loop(rx, exporter, transport, c))
            .map_err(|e| format!("cannot start the OTLP export thread: {e}"))?;
        Ok(Arc::new(Exporter {
            tx,
            sampling: Sampling::new(cfg.sample_ratio, cfg.parent_based),
            dropped: counters.dropped.clone(),
        }))
    }

    /// Is an allowed request of trace `t` exported (the ratio, or the incoming sampled flag)?
    /// Decided when it arrives, so a trace started here goes upstream marked sampled.
    pub fn head_sampled(&self, t: &TraceContext) -> bool {
        self.sampling.picks(t)
    }

    /// Is a request that ended so exported whatever the ratio says (denied, failed open, a
    /// 5xx or local error, or aborted)?
    pub fn always(decision: &str, status: u16, fail_open: bool, aborted: bool) -> bool {
        status == 429
            || status >= 500
            || fail_open
            || aborted
            || matches!(
                decision,
                "limited" | "unavailable" | "fail_open" | "error" | "client_aborted"
            )
    }

    /// Queue `f` for export; a full queue drops it (counted). Never blocks.
    pub fn offer(&self, f: Finished) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(f) {
            self.dropped.inc();
        }
    }
}

/// Which allowed requests are exported.
#[derive(Debug, Clone, Copy)]
struct Sampling {
    /// A trace is picked when its id's low 64 bits, hashed with `key`, are below this.
    threshold: u64,
    /// This process's secret for the hash: a caller chooses the trace id it sends, and without
    /// the key could choose one that is always picked (and fill the export queue).
    key: u64,
    /// `sample_ratio` is 1.
    all: bool,
    /// Follow an incoming sampled flag.
    parent_based: bool,
}

impl Sampling {
    fn new(ratio: f64, parent_based: bool) -> Sampling {
        Sampling {
            // `ratio * 2^64` (the cast saturates).
            threshold: (ratio * 18_446_744_073_709_551_616.0) as u64,
            key: crate::http::request_id::random_u64(),
            all: ratio >= 1.0,
            parent_based,
        }
    }

    fn picks(&self, t: &TraceContext) -> bool {
        if self.parent_based && t.parent_id.is_some() {
            return t.flags & 1 == 1;
        }
        let mut low = [0u8; 8];
        low.copy_from_slice(&t.trace_id[8..]);
        self.all || keyed(u64::from_be_bytes(low), self.key) < self.threshold
    }
}

/// `v` mixed with `key` (the splitmix64 finaliser): uniform over u64 for any `v`, and not
/// predictable without `key`.
fn keyed(v: u64, key: u64) -> u64 {
    let mut z = v ^ key;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The resource every span is exported under: `service.name` (and `service.version`).
fn resource(cfg: &OtlpConfig) -> opentelemetry_sdk::Resource {
    opentelemetry_sdk::Resource::builder_empty()
        .with_service_name(cfg.service_name.clone())
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build()
}

/// `opentelemetry-otlp`'s HTTP/protobuf span exporter for `cfg`, over `transport`.
fn span_exporter(cfg: &OtlpConfig, transport: Transport) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let headers = cfg
        .headers
        .iter()
        .map(|(n, v)| (n.as_str().to_string(), v.expose().to_string()))
        .collect();
    opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(transport)
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(cfg.endpoint.to_string())
        .with_timeout(cfg.timeout)
        .with_headers(headers)
        .build()
        .map_err(|e| format!("tracing.otlp: {e}"))
}

/// The export thread: records in, batches out, until the last [`Exporter`] is gone.
fn export_loop(
    rx: Receiver<Finished>,
    exporter: opentelemetry_otlp::SpanExporter,
    transport: Transport,
    counters: OtlpCounters,
) {
    let scope = InstrumentationScope::builder("tollgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut due: Option<Instant> = None;
    let mut failures_logged = 0u64;
    loop {
        let got = match due {
            Some(d) => rx.recv_timeout(d.saturating_duration_since(Instant::now())),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let closed = match got {
            Ok(f) => {
                batch.push(span_data(f, &scope));
                due.get_or_insert_with(|| Instant::now() + FLUSH_EVERY);
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        let is_due = due.is_some_and(|d| Instant::now() >= d);
        if !batch.is_empty() && (closed || is_due || batch.len() >= MAX_BATCH) {
            let n = batch.len() as u64;
            let spans = std::mem::replace(&mut batch, Vec::with_capacity(MAX_BATCH));
            match transport.handle.block_on(exporter.export(spans)) {
                Ok(()) => {
                    counters.exported.inc_by(n);
                }
                Err(e) => {
                    counters.failed.inc_by(n);
                    // The first failures, then one in a hundred: a collector that is down must
                    // not flood the log.
                    if failures_logged < 3 || failures_logged % 100 == 0 {
                        tracing::warn!(error = %e, spans = n, "OTLP span export failed (tollgate_otlp_spans_total{{result=\"failed\"}} counts them)");
                    }
                    failures_logged += 1;
                }
            }
            due = None;
        }
        if closed {
            let _ = exporter.shutdown();
            return;
        }
    }
}

/// Attributes per span, at most.
const ATTRIBUTES: usize = 16;

/// The SDK's span for `f`.
fn span_data(f: Finished, scope: &InstrumentationScope) -> SpanData {
    let t = &f.trace;
    let flags = TraceFlags::new(t.flags | 1);
    let mut attributes = Vec::with_capacity(ATTRIBUTES);
    attributes.push(KeyValue::new("http.request.method", f.method.as_str().to_string()));
    attributes.push(KeyValue::new("url.path", f.path));
    attributes.push(KeyValue::new("http.response.status_code", i64::from(f.status)));
    attributes.push(KeyValue::new("tollgate.decision", f.decision));
    if let Some(r) = &f.rule {
        attributes.push(KeyValue::new("tollgate.rule", r.to_string()));
    }
    if let Some(b) = f.binding {
        attributes.push(KeyValue::new("tollgate.binding.limit", clamp(b.limit)));
        attributes.push(KeyValue::new("tollgate.binding.window_ms", clamp(b.window_ms)));
        attributes.push(KeyValue::new("tollgate.binding.remaining", clamp(b.remaining)));
    }
    attributes.push(KeyValue::new("tollgate.fail_open", f.fail_open));
    if let Some(us) = f.store_us {
        attributes.push(KeyValue::new("tollgate.store.latency_us", clamp(us)));
    }
    if let Some(target) = &f.target {
        attributes.push(KeyValue::new("tollgate.upstream.target", target.to_string()));
        attributes.push(KeyValue::new("tollgate.upstream.attempts", i64::from(f.attempts)));
        attributes.push(KeyValue::new("tollgate.upstream.latency_us", clamp(f.upstream_us)));
    }
    attributes.push(KeyValue::new("tollgate.client_aborted", f.client_aborted));
    let status = if f.client_aborted {
        Status::error("client aborted")
    } else if f.status >= 500 {
        Status::error(format!("status {}", f.status))
    } else {
        Status::Unset
    };
    SpanData {
        span_context: SpanContext::new(
            TraceId::from_bytes(t.trace_id),
            SpanId::from_bytes(t.span_id),
            flags,
            false,
            TraceState::default(),
        ),
        parent_span_id: t.parent_id.map_or(SpanId::INVALID, SpanId::from_bytes),
        parent_span_is_remote: t.parent_id.is_some(),
        span_kind: SpanKind::Server,
        name: Cow::Owned(f.method.as_str().to_string()),
        start_time: f.start,
        end_time: f.end.max(f.start),
        attributes,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope.clone(),
    }
}

/// An OTLP integer attribute (i64).
fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The exporters' HTTP client: hyper's, on a one-thread tokio runtime of its own, so an export
/// works from any thread (the export thread, the SDK's batch thread) and never runs on the
/// request path's workers.
#[derive(Clone)]
pub struct Transport {
    /// The transport runtime (alive while a clone of this transport is).
    runtime: Arc<OwnedRuntime>,
    /// Its handle.
    handle: tokio::runtime::Handle,
    /// Pooled HTTP/1.1 connections to the collector.
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
    /// Deadline of one request.
    timeout: Duration,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("workers", &self.runtime.0.as_ref().map(|r| r.metrics().num_workers()))
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// A runtime shut down without waiting when the last transport goes: dropping a tokio runtime
/// blocks, which panics when that happens inside another runtime's task.
struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl Transport {
    /// Start the runtime (its thread runs while a clone of the transport is alive).
    fn start(timeout: Duration) -> Result<Transport, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tollgate-otlp-io")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the OTLP runtime: {e}"))?;
        let handle = rt.handle().clone();
        let client = {
            let _in = handle.enter();
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build_http()
        };
        Ok(Transport {
            runtime: Arc::new(OwnedRuntime(Some(rt))),
            handle,
            client,
            timeout,
        })
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Transport {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        use http_body_util::BodyExt;
        let (client, timeout) = (self.client.clone(), self.timeout);
        let req = request.map(http_body_util::Full::new);
        let task = self.handle.spawn(async move {
            let exchange = async {
                let resp = client.request(req).await?;
                let (parts, body) = resp.into_parts();
                let body = body.collect().await?.to_bytes();
                Ok::<_, opentelemetry_http::HttpError>(http::Response::from_parts(parts, body))
            };
            match tokio::time::timeout(timeout, exchange).await {
                Ok(r) => r,
                Err(_) => Err("the OTLP export timed out".into()),
            }
        });
        task.await?
    }
}

/// tollgate's background work as OTLP spans: a `tracing-opentelemetry` layer over an SDK
/// tracer (its batch processor on a thread of its own), for the `tracing` spans named
/// `tollgate.reload` and the events inside them. `None` when export is off or cannot start.
pub fn ops_layer<S>(cfg: &OtlpConfig) -> Result<impl tracing_subscriber::Layer<S>, String>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::Layer as _;
    let transport = Transport::start(cfg.timeout)?;
    let exporter = span_exporter(cfg, transport)?;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource(cfg))
        .build();
    let tracer = provider.tracer("tollgate");
    // Only spans named `tollgate.*` (and what is logged inside them) reach the layer: a span
    // per request would cost the request path.
    let filter = tracing_subscriber::filter::filter_fn(|m| !m.is_span() || m.name().starts_with("tollgate."));
    Ok(tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_filter(filter))
}

#[cfg(test)]
mod tests;
