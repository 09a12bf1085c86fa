// tollgate admin dashboard: fetches /dashboard.json every 2 s and redraws. No dependencies.
// Requests go to location.origin, never to a URL with credentials in it: the browser adds the
// HTTP Basic credentials it used to open this page.
"use strict";
(function () {
  var REFRESH_MS = 2000;
  var SVG = "http://www.w3.org/2000/svg";
  var refreshes = 0;
  var detailHash = null;

  function $(id) { return document.getElementById(id); }
  function el(tag, attrs) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) {
      if (k === "text") e.textContent = attrs[k];
      else if (k === "cls") e.className = attrs[k];
      else e.setAttribute(k, attrs[k]);
    }
    for (var i = 2; i < arguments.length; i++) {
      var c = arguments[i];
      if (c === null || c === undefined) continue;
      e.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
    }
    return e;
  }
  function fill(tbody, rows, empty, cols) {
    tbody.replaceChildren();
    if (rows.length === 0) {
      tbody.appendChild(el("tr", {}, el("td", { colspan: String(cols), cls: "muted", text: empty })));
    }
    rows.forEach(function (r) { tbody.appendChild(r); });
  }
  function pill(state) { return el("span", { cls: "pill " + state, text: state }); }
  function ago(at, now) {
    if (!at) return "–";
    var s = Math.max(0, now - at);
    if (s < 60) return s + " s ago";
    if (s < 3600) return Math.floor(s / 60) + " min ago";
    if (s < 86400) return Math.floor(s / 3600) + " h ago";
    return new Date(at * 1000).toISOString().slice(0, 16).replace("T", " ");
  }
  function num(n) { return Number(n).toLocaleString("en-US"); }

  function store(d) {
    var s = d.store;
    $("store-kind").textContent = s.kind;
    $("store-state").replaceWith(Object.assign(pill(s.state), { id: "store-state" }));
    $("store-errors").textContent = s.errors_last_minute ? num(s.errors_last_minute) + " errors in the last minute" : "";
    fill($("shards").tBodies[0], s.shards.map(function (sh) {
      return el("tr", {}, el("td", { cls: "hash", text: sh.addr }),
        el("td", {}, pill(sh.breaker_open ? "open" : "closed")),
        el("td", { cls: "n", text: num(sh.opened_total) + "×" }));
    }), "no shard known yet", 3);
    var h = $("store-history");
    h.replaceChildren();
    s.history.forEach(function (e) {
      h.appendChild(el("li", {}, el("span", { cls: "muted", text: ago(e.at, d.now) + " " }), e.what));
    });
  }

  function rulesCard(d) {
    var r = d.rules;
    $("rules-version").textContent = r.version;
    $("rules-count").textContent = num(r.count);
    $("rules-keys").textContent = num(r.api_keys);
    $("rules-loaded").textContent = r.loaded_at;
    $("config-changed").hidden = !r.config_file_changed;
    fill($("reloads").tBodies[0], r.reloads.map(function (e) {
      var what;
      if (e.ok) {
        var c = e.rules ? " (rules +" + e.rules.added + " −" + e.rules.removed + " ~" + e.rules.changed +
          ", keys +" + e.keys.added + " −" + e.keys.removed + " ~" + e.keys.changed + ")" : "";
        what = el("td", {}, el("code", { text: e.version }), e.changed ? c : " unchanged");
      } else {
        what = el("td", { cls: "err", text: e.error });
      }
      return el("tr", { "data-ok": String(e.ok) }, el("td", { text: ago(e.at, d.now) }), el("td", { text: e.trigger }),
        el("td", {}, pill(e.ok ? "ok" : "refused")), what);
    }), "none yet", 4);
  }

  function upstreams(d) {
    var ul = $("upstreams");
    ul.replaceChildren();
    if (d.upstreams.length === 0) ul.appendChild(el("li", { cls: "muted", text: "no upstream" }));
    d.upstreams.forEach(function (u) {
      ul.appendChild(el("li", { "data-upstream": u.url },
        el("div", {}, el("code", { text: u.url }), " ", pill(u.state)),
        el("div", { cls: "muted small", "data-target-totals": "", text: "this target: " + num(u.responses_total) + " responses · " +
          num(u.failures_total) + " failures · ejected " + num(u.ejections_total) + "× since start" }),
        el("div", { cls: "muted small", text: "whole upstream: " + num(u.responses_last_minute) + " responses · " +
          num(u.failures_last_minute) + " failures in the last minute · last failure " + ago(u.last_failure_at, d.now) })));
    });
    var ej = $("ejections");
    ej.replaceChildren();
    if (d.recent_ejections.length === 0) ej.appendChild(el("li", { cls: "muted", text: "no ejection since start" }));
    d.recent_ejections.forEach(function (e) {
      ej.appendChild(el("li", { "data-ejection": e.target },
        el("code", { text: e.target }), " out for " + num(Math.round(e.out_for_ms / 1000)) + " s, " + ago(e.at, d.now) + ": ",
        el("span", { cls: "muted small", text: e.why })));
    });
  }

  function rlsDomains(d) {
    var card = $("rls-card");
    card.hidden = !d.rls;
    if (!d.rls) return;
    var ul = $("rls-domains");
    ul.replaceChildren();
    if (d.rls.domains.length === 0) ul.appendChild(el("li", { cls: "muted", text: "no domain loaded" }));
    d.rls.domains.forEach(function (r) {
      ul.appendChild(el("li", { "data-rls-domain": r.name },
        el("div", {}, el("code", { text: r.name }), " ", el("span", { cls: "muted small", text: r.file + " · " + num(r.limits) + " limits" })),
        el("div", { cls: "muted small", "data-rls-totals": "", text: num(r.calls_ok) + " calls OK · " + num(r.calls_over_limit) +
          " over the limit · " + num(r.descriptors_over_limit) + " descriptors over the limit since start" })));
    });
  }

  function showDetail(hash) {
    detailHash = hash;
    var box = $("detail");
    box.hidden = false;
    box.replaceChildren(el("p", { cls: "muted", text: "loading " + hash + "…" }));
    fetch(location.origin + "/dashboard/limited/" + hash, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.ok ? r.json() : Promise.reject(new Error("HTTP " + r.status)); })
      .then(function (x) {
        var rows = x.counters.map(function (c) {
          // A token budget counts its unit (tokens) and shows what is reserved in flight.
          var unit = c.unit ? " " + c.unit : "";
          return el("tr", {}, el("td", { text: c.rule }), el("td", { text: c.limit + unit }),
            el("td", { cls: "n", text: c.tracked ? num(c.remaining) + unit : "untracked" }),
            el("td", { cls: "n", "data-reserved": "", text: c.unit ? num(c.reserved) + unit : "–" }),
            el("td", { cls: "n", text: c.tracked ? (c.reset_ms / 1000).toFixed(1) + " s" : "–" }),
            // A global limit: each region's spend of this window.
            el("td", { "data-regions": "", text: c.regions ? Object.keys(c.regions).map(function (r) {
              return r + " " + num(c.regions[r]);
            }).join(" · ") : "–" }));
        });
        var t = el("table", {}, el("thead", {}, el("tr", {}, el("th", { text: "rule" }), el("th", { text: "limit" }),
          el("th", { cls: "n", text: "remaining" }), el("th", { cls: "n", text: "reserved" }),
          el("th", { cls: "n", text: "resets in" }), el("th", { text: "spent by region" }))), el("tbody"));
        fill(t.tBodies[0], rows, "no counters", 6);
        box.replaceChildren(el("p", {}, "Counters of ", el("span", { cls: "hash", text: x.hash }), " now · ",
          el("a", { href: "/dashboard/limited/" + x.hash, text: "JSON" }), " · ",
          el("a", { href: "#", id: "detail-close", text: "close" })), el("div", { cls: "scroll" }, t));
        $("detail-close").onclick = function (ev) { ev.preventDefault(); detailHash = null; box.hidden = true; };
      })
      .catch(function (e) { box.replaceChildren(el("p", { cls: "err", text: "detail unavailable: " + e.message })); });
  }

  function limited(d) {
    fill($("limited").tBodies[0], d.limited.map(function (l) {
      var a = el("a", { href: "/dashboard/limited/" + l.hash, cls: "hash", text: l.hash, "data-hash": l.hash });
      a.onclick = function (ev) { ev.preventDefault(); showDetail(l.hash); };
      return el("tr", { "data-limited": l.hash }, el("td", {}, a), el("td", { text: l.rule }), el("td", { text: l.key }),
        el("td", { cls: "n", text: num(l.denials) }), el("td", { text: ago(l.last_seen, d.now) }));
    }), "no denials in the last 5 minutes", 5);
  }

  // One small SVG line chart: allowed, denied, shadow-denied per second.
  function chart(perSecond) {
    var n = perSecond.length || 300;
    var max = 1;
    perSecond.forEach(function (s) { max = Math.max(max, s[0], s[1], s[2]); });
    var svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("class", "chart");
    svg.setAttribute("viewBox", "0 0 " + (n - 1) + " 100");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("role", "img");
    ["allowed", "denied", "would_deny"].forEach(function (name, k) {
      var pts = perSecond.map(function (s, i) { return i + "," + (98 - (s[k] / max) * 94).toFixed(1); });
      if (pts.length === 0) pts = ["0,98", (n - 1) + ",98"];
      var p = document.createElementNS(SVG, "polyline");
      p.setAttribute("class", name);
      p.setAttribute("points", pts.join(" "));
      svg.appendChild(p);
    });
    return { svg: svg, max: max };
  }

  // Adaptive concurrency: the limit and the most in flight per second (history rows are
  // [unix second, limit, most in flight]), and the classes.
  function adaptive(d) {
    var a = d.adaptive;
    $("adaptive-card").hidden = !a;
    if (!a) return;
    $("adaptive-limit").textContent = String(a.limit);
    $("adaptive-in-flight").textContent = String(a.in_flight);
    $("adaptive-queued").textContent = String(a.queued);
    var ms = function (v) { return v === null ? "–" : v + " ms"; };
    $("adaptive-latency").textContent = ms(a.latency_ms);
    $("adaptive-baseline").textContent = ms(a.baseline_ms);
    var rows = a.history.map(function (h) { return [h[1], h[2], 0]; });
    var c = chart(rows);
    c.svg.setAttribute("data-points", String(rows.length));
    $("adaptive-chart").replaceChildren(c.svg,
      el("div", { cls: "axis" }, el("span", { text: "−2 min" }), el("span", { text: "peak " + num(c.max) }), el("span", { text: "now" })));
    fill($("adaptive-classes").tBodies[0], a.classes.map(function (k) {
      return el("tr", { "data-class": k.name }, el("td", { text: k.name }), el("td", { text: String(k.guaranteed_slots) }),
        el("td", { text: String(k.in_flight) }), el("td", { text: String(k.waiting) }),
        el("td", { "data-admitted": "", text: num(k.admitted) }), el("td", { "data-refused": "", text: num(k.refused) }));
    }), "no classes", 6);
  }

  function traffic(d) {
    var s = d.series;
    $("traffic-note").textContent = s.rules_total > s.rules.length
      ? "(the " + s.rules.length + " busiest of " + s.rules_total + " rules)" : "";
    var box = $("rules");
    box.replaceChildren();
    if (s.rules.length === 0) box.appendChild(el("p", { cls: "muted", text: "no rules loaded" }));
    s.rules.forEach(function (r) {
      var c = chart(r.per_second);
      var cell = function (dec, v) { return el("span", { "data-rule": r.name, "data-decision": dec, text: String(v) }); };
      box.appendChild(el("article", { cls: "rule", "data-rule": r.name },
        el("h3", { text: r.name + (r.shadow ? " (shadow)" : "") }),
        el("p", { cls: "meta muted small", text: "key " + r.key + " · " + r.limits.join(" + ") }),
        el("div", { cls: "totals" },
          el("span", { cls: "l" }), el("span", { cls: "h", text: "allowed" }), el("span", { cls: "h", text: "denied" }),
          el("span", { cls: "h", text: "shadow-denied" }),
          el("span", { cls: "l", text: "total" }), cell("allowed", r.totals.allowed), cell("denied", r.totals.denied),
          cell("would_deny", r.totals.would_deny),
          el("span", { cls: "l", text: "5 min" }), el("span", { text: num(r.last_5m.allowed) }),
          el("span", { text: num(r.last_5m.denied) }), el("span", { text: num(r.last_5m.would_deny) })),
        c.svg,
        el("div", { cls: "axis" }, el("span", { text: "−5 min" }), el("span", { text: "peak " + num(c.max) + "/s" }), el("span", { text: "now" }))));
    });
  }

  function render(d) {
    $("version").textContent = "v" + d.version;
    var overall = d.store.state === "ok" && d.rules.last_reload_ok ? "ok" : (d.store.state === "ok" ? "degraded" : d.store.state);
    var o = pill(overall); o.id = "overall"; $("overall").replaceWith(o);
    $("updated").textContent = "updated " + new Date(d.now * 1000).toLocaleTimeString();
    store(d); rulesCard(d); upstreams(d); rlsDomains(d); adaptive(d); limited(d); traffic(d);
    refreshes += 1;
    document.body.setAttribute("data-refreshes", String(refreshes));
    document.body.setAttribute("data-sampled-at", String(d.sampled_at));
  }

  function refresh() {
    fetch(location.origin + "/dashboard.json", { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (r.status === 401) throw new Error("the admin token is needed: reload the page and sign in (any user name, the token as the password)");
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      })
      .then(function (d) { $("error").hidden = true; render(d); })
      .catch(function (e) { $("error").textContent = "Cannot refresh: " + e.message; $("error").hidden = false; })
      .finally(function () { setTimeout(refresh, REFRESH_MS); });
  }
  refresh();
})();
