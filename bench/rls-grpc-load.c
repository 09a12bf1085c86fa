/* bench/rls-grpc-load.c — a gRPC load generator for `tollgate rls` whose body varies per call.
 *
 * h2load sends one prebuilt body for every call, so it cannot rotate descriptors. This sends
 * ShouldRateLimit calls (unary, uncompressed) over HTTP/2 cleartext with libnghttp2 (the library
 * h2load is built on), each call carrying the next of COUNT prebuilt RateLimitRequest frames:
 *   domain DOMAIN, one descriptor with one entry KEY=<n>, n zero-padded to 6 digits (COUNT > 1),
 *   or KEY=VALUE (-v, one fixed frame)
 * The frames are built once, before the clock starts; per call there is no protobuf work, only
 * a pointer into that buffer. THREADS threads (pthreads) each run CONNECTIONS/THREADS connections
 * (rounded up for the first ones) with STREAMS calls in flight on each; thread i starts its
 * rotation at i * COUNT / THREADS.
 *
 * A call counts as OK when the stream closes without error, :status is 200, grpc-status is 0
 * and the response message begins with overall_code = OK (field 1, varint 1: bytes 08 01; a
 * message whose overall_code is OK but that starts with another field would be counted not OK,
 * which prost, tollgate's encoder, does not produce).
 *
 * Build: cc -O2 -o rls-grpc-load bench/rls-grpc-load.c -lnghttp2 -lpthread (libnghttp2-dev)
 * Usage: rls-grpc-load [-t THREADS] [-c CONNECTIONS] [-m STREAMS] [-D SECONDS] [-d DOMAIN]
 *                      [-k KEY] [-n COUNT | -v VALUE] [--dump] HOST PORT
 *   --dump  write the frames (5-byte gRPC prefix + message, each) to stdout and exit (to check
 *           the encoding against another encoder's)
 * Output (stdout), one "name value" a line: completed, ok, notok, errors (connection errors),
 * elapsed_s, rps, client_cpu_us_per_call (this process's utime+stime / completed).
 * Exit status 0 if every connection ran to the end, 1 otherwise.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <nghttp2/nghttp2.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define PATH "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"

static const char *g_host = "127.0.0.1", *g_port;
static char g_authority[300];
static int g_threads = 1, g_conns = 4, g_streams = 16;
static double g_duration = 10;
static unsigned char *g_frames;     /* COUNT frames of g_flen bytes each */
static size_t g_flen, g_count = 1;
static double g_deadline;           /* monotonic seconds: no new call after it */

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}
static void die(const char *m) { fprintf(stderr, "rls-grpc-load: %s\n", m); exit(2); }

/* protobuf: a length-delimited field (tag, length < 128, bytes) */
static size_t put_ld(unsigned char *p, int field, const unsigned char *b, size_t n) {
  if (n > 127) die("field over 127 bytes");
  p[0] = (unsigned char)(field << 3 | 2); p[1] = (unsigned char)n; memcpy(p + 2, b, n);
  return n + 2;
}
/* one gRPC frame: RateLimitRequest { domain, descriptors [{ entries [{ key, value }] }] } */
static size_t build_frame(unsigned char *out, const char *domain, const char *key, const char *value) {
  unsigned char entry[300], desc[300], msg[700];
  size_t e = 0, d, m = 0;
  e += put_ld(entry + e, 1, (const unsigned char *)key, strlen(key));
  e += put_ld(entry + e, 2, (const unsigned char *)value, strlen(value));
  d = put_ld(desc, 1, entry, e);                                   /* RateLimitDescriptor.entries */
  m += put_ld(msg + m, 1, (const unsigned char *)domain, strlen(domain));  /* domain */
  m += put_ld(msg + m, 2, desc, d);                                /* descriptors */
  out[0] = 0; out[1] = (unsigned char)(m >> 24); out[2] = (unsigned char)(m >> 16);
  out[3] = (unsigned char)(m >> 8); out[4] = (unsigned char)m;
  memcpy(out + 5, msg, m);
  return m + 5;
}

typedef struct {
  int status, grpc_ok, nread;
  unsigned char head[7];
  const unsigned char *body;
  size_t sent;
} call_t;

struct worker;
typedef struct {
  struct worker *w;
  int fd, dead, want_out;
  nghttp2_session *s;
  int inflight;
  size_t ooff, olen;                /* unsent bytes: obuf[ooff, olen) */
  unsigned char obuf[1 << 16];
} conn_t;

typedef struct worker {
  int id, nconns, epfd;
  conn_t *conns;
  size_t next;                      /* rotation index */
  unsigned long completed, ok, notok, errors;
} worker_t;

static ssize_t read_cb(nghttp2_session *s, int32_t sid, uint8_t *buf, size_t len, uint32_t *flags,
                       nghttp2_data_source *src, void *ud) {
  call_t *k = src->ptr; (void)s; (void)sid; (void)ud;
  size_t n = g_flen - k->sent;
  if (n > len) n = len;
  memcpy(buf, k->body + k->sent, n);
  k->sent += n;
  if (k->sent == g_flen) *flags |= NGHTTP2_DATA_FLAG_EOF;
  return (ssize_t)n;
}
static int header_cb(nghttp2_session *s, const nghttp2_frame *f, const uint8_t *name, size_t nl,
                     const uint8_t *value, size_t vl, uint8_t flags, void *ud) {
  (void)flags; (void)ud;
  call_t *k = nghttp2_session_get_stream_user_data(s, f->hd.stream_id);
  if (!k) return 0;
  if (nl == 7 && !memcmp(name, ":status", 7)) k->status = (vl == 3 && !memcmp(value, "200", 3)) ? 200 : -1;
  else if (nl == 11 && !memcmp(name, "grpc-status", 11)) k->grpc_ok = (vl == 1 && value[0] == '0') ? 1 : -1;
  return 0;
}
static int data_cb(nghttp2_session *s, uint8_t flags, int32_t sid, const uint8_t *data, size_t len, void *ud) {
  (void)flags; (void)ud;
  call_t *k = nghttp2_session_get_stream_user_data(s, sid);
  if (!k) return 0;
  while (len > 0 && k->nread < 7) { k->head[k->nread++] = *data++; len--; }
  return 0;
}
static int submit(conn_t *c);
static int close_cb(nghttp2_session *s, int32_t sid, uint32_t err, void *ud) {
  conn_t *c = ud;
  call_t *k = nghttp2_session_get_stream_user_data(s, sid);
  if (!k) return 0;
  worker_t *w = c->w;
  w->completed++;
  if (err == 0 && k->status == 200 && k->grpc_ok == 1 && k->nread == 7 && k->head[5] == 0x08 && k->head[6] == 0x01)
    w->ok++;
  else
    w->notok++;
  free(k);
  c->inflight--;
  if (now() < g_deadline) return submit(c) ? NGHTTP2_ERR_CALLBACK_FAILURE : 0;
  return 0;
}

static int submit(conn_t *c) {
  worker_t *w = c->w;
  call_t *k = calloc(1, sizeof *k);
  if (!k) return -1;
  k->body = g_frames + (w->next % g_count) * g_flen;
  w->next++;
#define NV(n, v) { (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, strlen(v), NGHTTP2_NV_FLAG_NO_COPY_NAME }
  nghttp2_nv h[] = { NV(":method", "POST"), NV(":scheme", "http"), NV(":path", PATH),
                     NV(":authority", g_authority), NV("content-type", "application/grpc"),
                     NV("te", "trailers") };
  nghttp2_data_provider dp = { .source.ptr = k, .read_callback = read_cb };
  int32_t sid = nghttp2_submit_request(c->s, NULL, h, sizeof h / sizeof h[0], &dp, k);
  if (sid < 0) { free(k); return -1; }
  c->inflight++;
  return 0;
}

static int dial(void) {
  struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, *ai;
  if (getaddrinfo(g_host, g_port, &hints, &ai)) die("cannot resolve host");
  int fd = socket(ai->ai_family, SOCK_STREAM, 0);
  if (fd < 0 || connect(fd, ai->ai_addr, ai->ai_addrlen)) die("cannot connect");
  freeaddrinfo(ai);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

static void conn_fail(conn_t *c) {
  if (c->dead) return;
  c->dead = 1; c->w->errors++;
  /* calls still in flight are lost: count them as completed and not OK */
  c->w->completed += c->inflight; c->w->notok += c->inflight; c->inflight = 0;
  epoll_ctl(c->w->epfd, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
}

/* Writes what nghttp2 has queued, gathered into one buffer per send() (nghttp2_session_send
 * would make one send() per frame), and waits for EPOLLOUT only while bytes are left over. */
static void conn_update(conn_t *c) {
  if (c->dead) return;
  for (;;) {
    while (c->olen < sizeof c->obuf / 2) {
      const uint8_t *d;
      ssize_t n = nghttp2_session_mem_send(c->s, &d);
      if (n < 0) { conn_fail(c); return; }
      if (n == 0) break;
      if ((size_t)n > sizeof c->obuf - c->olen) {   /* not room: send what is there first */
        ssize_t w = send(c->fd, c->obuf + c->ooff, c->olen - c->ooff, MSG_NOSIGNAL);
        if (w < 0 && errno != EAGAIN) { conn_fail(c); return; }
        if (w > 0) c->ooff += (size_t)w;
        memmove(c->obuf, c->obuf + c->ooff, c->olen - c->ooff); c->olen -= c->ooff; c->ooff = 0;
        if ((size_t)n > sizeof c->obuf - c->olen) die("frame larger than the output buffer");
      }
      memcpy(c->obuf + c->olen, d, (size_t)n); c->olen += (size_t)n;
    }
    if (c->ooff == c->olen) { c->ooff = c->olen = 0; break; }
    ssize_t w = send(c->fd, c->obuf + c->ooff, c->olen - c->ooff, MSG_NOSIGNAL);
    if (w < 0 && errno != EAGAIN) { conn_fail(c); return; }
    if (w > 0) c->ooff += (size_t)w;
    if (c->ooff < c->olen) {                  /* socket full */
      memmove(c->obuf, c->obuf + c->ooff, c->olen - c->ooff); c->olen -= c->ooff; c->ooff = 0;
      break;
    }
    c->ooff = c->olen = 0;
    if (!nghttp2_session_want_write(c->s)) break;
  }
  int want = c->olen > 0;
  if (want != c->want_out) {
    struct epoll_event ev = { .events = EPOLLIN | (want ? EPOLLOUT : 0), .data.ptr = c };
    epoll_ctl(c->w->epfd, EPOLL_CTL_MOD, c->fd, &ev);
    c->want_out = want;
  }
}

static void *run(void *arg) {
  worker_t *w = arg;
  nghttp2_session_callbacks *cb;
  nghttp2_session_callbacks_new(&cb);
  nghttp2_session_callbacks_set_on_header_callback(cb, header_cb);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, data_cb);
  nghttp2_session_callbacks_set_on_stream_close_callback(cb, close_cb);
  w->epfd = epoll_create1(0);
  for (int i = 0; i < w->nconns; i++) {
    conn_t *c = &w->conns[i];
    c->w = w; c->fd = dial();
    nghttp2_session_client_new(&c->s, cb, c);
    nghttp2_settings_entry st[] = { { NGHTTP2_SETTINGS_ENABLE_PUSH, 0 },
                                    { NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1 << 24 } };
    nghttp2_submit_settings(c->s, NGHTTP2_FLAG_NONE, st, 2);
    nghttp2_session_set_local_window_size(c->s, NGHTTP2_FLAG_NONE, 0, 1 << 30);
    struct epoll_event ev = { .events = EPOLLIN, .data.ptr = c };
    epoll_ctl(w->epfd, EPOLL_CTL_ADD, c->fd, &ev);
    for (int j = 0; j < g_streams; j++) if (submit(c)) die("submit failed");
    conn_update(c);
  }
  nghttp2_session_callbacks_del(cb);
  struct epoll_event evs[64];
  unsigned char buf[65536];
  double hard = g_deadline + 10;    /* in-flight calls get 10 s to finish after the deadline */
  for (;;) {
    int live = 0;
    for (int i = 0; i < w->nconns; i++) if (!w->conns[i].dead && w->conns[i].inflight > 0) live = 1;
    if (!live) break;
    if (now() > hard) {
      for (int i = 0; i < w->nconns; i++) conn_fail(&w->conns[i]);
      break;
    }
    int n = epoll_wait(w->epfd, evs, 64, 100);
    for (int i = 0; i < n; i++) {
      conn_t *c = evs[i].data.ptr;
      if (c->dead) continue;
      if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
        for (;;) {
          ssize_t r = recv(c->fd, buf, sizeof buf, 0);
          if (r > 0) {
            if (nghttp2_session_mem_recv(c->s, buf, (size_t)r) < 0) { conn_fail(c); break; }
            if ((size_t)r < sizeof buf) break;
          } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
          else { conn_fail(c); break; }
        }
      }
      conn_update(c);
    }
  }
  for (int i = 0; i < w->nconns; i++) {
    conn_t *c = &w->conns[i];
    if (!c->dead) { nghttp2_session_terminate_session(c->s, NGHTTP2_NO_ERROR); conn_update(c); close(c->fd); }
    nghttp2_session_del(c->s);
  }
  close(w->epfd);
  return NULL;
}

int main(int argc, char **argv) {
  const char *domain = "bench", *key = "client", *value = NULL;
  int dump = 0;
  char *pos[2]; int np = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--dump")) { dump = 1; continue; }
    if (a[0] == '-' && a[1] && !a[2] && strchr("tcmDdknv", a[1])) {
      if (++i >= argc) die("option needs a value");
      const char *v = argv[i];
      switch (a[1]) {
        case 't': g_threads = atoi(v); break;
        case 'c': g_conns = atoi(v); break;
        case 'm': g_streams = atoi(v); break;
        case 'D': g_duration = atof(v); break;
        case 'd': domain = v; break;
        case 'k': key = v; break;
        case 'n': g_count = strtoul(v, NULL, 10); break;
        case 'v': value = v; break;
      }
      continue;
    }
    if (a[0] == '-' || np == 2) die("usage: rls-grpc-load [-t T] [-c C] [-m M] [-D S] [-d DOMAIN] [-k KEY] [-n COUNT | -v VALUE] [--dump] HOST PORT");
    pos[np++] = argv[i];
  }
  if (g_threads < 1 || g_conns < g_threads || g_streams < 1 || g_duration <= 0) die("bad -t/-c/-m/-D");
  if (value) g_count = 1;
  if (g_count < 1 || g_count > 1000000) die("-n must be 1..1000000");
  unsigned char one[1024];
  char v6[24];
  snprintf(v6, sizeof v6, "%06d", 0);
  g_flen = build_frame(one, domain, key, value ? value : v6);
  g_frames = malloc(g_flen * g_count);
  if (!g_frames) die("out of memory");
  for (size_t n = 0; n < g_count; n++) {
    if (!value) snprintf(v6, sizeof v6, "%06zu", n);
    if (build_frame(g_frames + n * g_flen, domain, key, value ? value : v6) != g_flen) die("frames differ in length");
  }
  if (dump) { fwrite(g_frames, g_flen, g_count, stdout); return 0; }
  if (np != 2) die("HOST and PORT needed");
  g_host = pos[0]; g_port = pos[1];
  snprintf(g_authority, sizeof g_authority, "%s:%s", g_host, g_port);

  worker_t *ws = calloc((size_t)g_threads, sizeof *ws);
  pthread_t *th = calloc((size_t)g_threads, sizeof *th);
  struct rusage ru0, ru;
  getrusage(RUSAGE_SELF, &ru0);
  double t0 = now();
  g_deadline = t0 + g_duration;
  for (int i = 0; i < g_threads; i++) {
    ws[i].id = i;
    ws[i].nconns = g_conns / g_threads + (i < g_conns % g_threads);
    ws[i].conns = calloc((size_t)ws[i].nconns, sizeof(conn_t));
    if (!ws[i].conns) die("out of memory");
    ws[i].next = (size_t)i * g_count / (size_t)g_threads;
    pthread_create(&th[i], NULL, run, &ws[i]);
  }
  unsigned long completed = 0, ok = 0, notok = 0, errors = 0;
  for (int i = 0; i < g_threads; i++) {
    pthread_join(th[i], NULL);
    completed += ws[i].completed; ok += ws[i].ok; notok += ws[i].notok; errors += ws[i].errors;
  }
  double el = now() - t0;
  getrusage(RUSAGE_SELF, &ru);
#define SECS(r) ((r).ru_utime.tv_sec + (r).ru_utime.tv_usec / 1e6 + (r).ru_stime.tv_sec + (r).ru_stime.tv_usec / 1e6)
  double cpu = SECS(ru) - SECS(ru0);
  printf("completed %lu\nok %lu\nnotok %lu\nerrors %lu\nelapsed_s %.3f\nrps %.1f\nclient_cpu_us_per_call %.2f\n",
         completed, ok, notok, errors, el, completed / el, completed ? cpu * 1e6 / completed : 0.0);
  return errors ? 1 : 0;
}
