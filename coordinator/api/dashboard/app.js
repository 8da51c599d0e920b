// The coordinator's live dashboard: polls GET /v1/status and redraws the page from it.
//
// Plain browser JavaScript, no build step and nothing loaded from elsewhere. Every string in the
// status is untrusted: it reaches the page only as text (textContent, text nodes, attribute
// values), never as markup. The eval-loss chart is inline SVG drawn here.
"use strict";

(() => {
  const SVG_NS = "http://www.w3.org/2000/svg";
  // The first request asks for a long history (for the chart), later ones for recent rounds;
  // the chart keeps every round it has seen, so it grows past what one poll returns.
  const FIRST_ROUNDS = 1000;
  const POLL_ROUNDS = 50;
  const TABLE_ROUNDS = 12;
  const params = new URLSearchParams(window.location.search);
  const POLL_S = Math.min(60, Math.max(0.2, Number(params.get("poll")) || 2));

  const evalLoss = new Map(); // round -> mean eval loss the nodes reported
  let runId = null;
  let fetched = false;

  // ---- small DOM helpers: text only, never markup ----

  function $(id) {
    return document.getElementById(id);
  }

  // An HTML element with attributes and children (strings become text nodes).
  function h(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      node.setAttribute(name, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  // An SVG element with attributes.
  function s(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      node.setAttribute(name, String(value));
    }
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function setText(id, text) {
    $(id).textContent = text;
  }

  // ---- formatting ----

  function bytes(n) {
    if (!Number.isFinite(n)) return "–";
    if (n < 1000) return `${n} B`;
    if (n < 1e6) return `${(n / 1e3).toFixed(1)} kB`;
    if (n < 1e9) return `${(n / 1e6).toFixed(1)} MB`;
    return `${(n / 1e9).toFixed(2)} GB`;
  }

  function age(seconds) {
    if (!Number.isFinite(seconds)) return "–";
    if (seconds < 10) return `${seconds.toFixed(1)} s ago`;
    if (seconds < 120) return `${Math.round(seconds)} s ago`;
    if (seconds < 7200) return `${Math.round(seconds / 60)} min ago`;
    return `${Math.round(seconds / 3600)} h ago`;
  }

  function seconds(value) {
    return Number.isFinite(value) ? `${value.toFixed(value < 10 ? 2 : 1)} s` : "–";
  }

  function short(fingerprint) {
    return String(fingerprint).slice(0, 8);
  }

  function mean(values) {
    const xs = values.filter((v) => typeof v === "number" && Number.isFinite(v));
    return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null;
  }

  function badge(state) {
    const text = String(state);
    return h("span", { class: `badge state-${text.replace(/[^a-z]/g, "-")}` }, text);
  }

  // ---- what the status says ----

  function reportsOf(summary) {
    return Object.values(summary.reports || {});
  }

  // Whether every node reported the same θ after the round; who differs from the majority.
  function agreement(summary) {
    const entries = Object.entries(summary.fingerprints || {});
    if (!entries.length) return { kind: "none", differ: [], count: 0 };
    const counts = new Map();
    for (const [, fp] of entries) counts.set(fp, (counts.get(fp) || 0) + 1);
    let majority = null;
    for (const [fp, n] of [...counts].sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0))) {
      if (majority === null || n > counts.get(majority)) majority = fp;
    }
    const differ = entries.filter(([, fp]) => fp !== majority).map(([node]) => node).sort();
    return {
      kind: differ.length ? "differ" : "agree",
      fingerprint: majority,
      differ,
      count: entries.length,
    };
  }

  // ---- rendering ----

  function renderHeader(status) {
    const run = status.run || {};
    setText("run-id", status.run_id);
    // Rounds are numbered from 0; a finished run's round is one past its last, so it says how
    // many rounds there were instead of naming a round that never ran.
    const counter =
      status.state === "finished"
        ? `${run.rounds} of ${run.rounds} rounds done`
        : `round ${status.round} of ${run.rounds}`;
    setText("round-counter", counter);
    const state = $("run-state");
    state.textContent = status.state;
    state.className = `badge state-${String(status.state).replace(/[^a-z]/g, "-")}`;
    const active = (status.members || []).filter((m) => m.state === "active").length;
    let note = "";
    if (status.state === "waiting") {
      note = `waiting for members: ${active} active, ${run.min_nodes} needed`;
    } else if (status.state === "open") {
      note = `training round ${status.round} with ${active} active member${active === 1 ? "" : "s"}`;
    } else if (status.state === "finished") {
      note = `all ${run.rounds} rounds closed`;
    }
    setText("run-note", note);
    const t = run.timing || {};
    setText(
      "run-config",
      `${run.name} · model ${run.model} · H ${run.inner_steps} · top-k ${run.topk} per tile` +
        ` · gather ≤ ${run.gather_size} · min nodes ${run.min_nodes}` +
        ` · checkpoint every ${run.checkpoint_every} · heartbeat timeout ${t.heartbeat_timeout_s} s`,
    );
    document.title = `${status.state} · ${counter} · sparseloco`;
  }

  // Each node's newest training speed: tokens/s (and MFU where its device's peak is known).
  function speeds(status) {
    const out = new Map();
    for (const r of status.rounds || []) {
      for (const [node, report] of Object.entries(r.reports || {})) {
        if (typeof report.tokens_per_s !== "number") continue;
        const mfu =
          typeof report.mfu === "number" ? ` · MFU ${(100 * report.mfu).toFixed(1)} %` : "";
        out.set(node, `${Math.round(report.tokens_per_s).toLocaleString("en")}${mfu}`);
      }
    }
    return out;
  }

  function renderMembers(status) {
    const members = status.members || [];
    const speed = speeds(status);
    const rows = members.map((m) =>
      h(
        "tr",
        { "data-node": m.node_id },
        h("td", { class: "mono node" }, m.node_id),
        h(
          "td",
          { class: "member-state" },
          badge(m.state),
          m.state === "active" && m.condition ? h("span", { class: "muted" }, ` ${m.condition}`) : null,
        ),
        h("td", { class: "num" }, String(m.slot)),
        h("td", { class: "num" }, `round ${m.joined_round}`),
        h("td", { class: "num" }, m.state === "active" ? age(m.last_seen_s) : "–"),
        // A revoked node takes no further part: its last speed is not a live figure.
        h("td", { class: "num speed" }, (m.state !== "revoked" && speed.get(m.node_id)) || "–"),
      ),
    );
    $("members").tBodies[0].replaceChildren(...rows);
    $("members").hidden = rows.length === 0;
    $("members-empty").hidden = rows.length !== 0;
  }

  function renderCheckpoint(status) {
    const c = status.checkpoint;
    const box = $("checkpoint");
    if (!c) {
      box.replaceChildren("none yet");
      return;
    }
    box.replaceChildren(
      h("strong", {}, `θ at the start of round ${c.round}`),
      h("br"),
      "fingerprint ",
      h("span", { class: "mono", title: c.fingerprint }, short(c.fingerprint)),
      ` · ${bytes(c.size)} · uploaded by `,
      h("span", { class: "mono" }, c.node_id),
      h("br"),
      h("span", { class: "mono muted key" }, c.key),
    );
  }

  function nodeList(nodes) {
    if (!nodes.length) return h("span", { class: "muted" }, "–");
    const list = h("span", { class: "nodes" });
    nodes.forEach((node, i) => {
      if (i) list.append(" ");
      list.append(h("span", { class: "chip mono" }, node));
    });
    return list;
  }

  // The gather set with each payload's work: a node that brought less than a whole round
  // (its time budget or its link cut it short) shows its steps of H, its share of the round's
  // work and what cut it.
  function gatherCell(summary, inner) {
    const cell = h("td", { class: "gather" });
    const nodes = summary.gather || [];
    if (!nodes.length) {
      cell.append(h("span", { class: "muted" }, "–"));
      return cell;
    }
    const list = h("span", { class: "nodes" });
    nodes.forEach((node, i) => {
      if (i) list.append(" ");
      const work = (summary.work || {})[node] || {};
      const report = (summary.reports || {})[node] || {};
      const steps = typeof work.steps === "number" ? work.steps : inner;
      const share = typeof work.share === "number" ? `${Math.round(100 * work.share)} % of the work` : "";
      const chip = h(
        "span",
        { class: "chip mono", "data-node": node, title: [`${steps} of ${inner} steps`, share].filter(Boolean).join(", ") },
        node,
      );
      list.append(chip);
      if (steps < inner || report.cut) {
        const cut = report.cut ? ` ${report.cut}` : "";
        const topk = typeof report.topk === "number" ? ` k=${report.topk}` : "";
        list.append(h("span", { class: "cut", "data-node": node }, ` ${steps}/${inner}${cut}${topk}`));
      }
    });
    cell.append(list);
    return cell;
  }

  function exclusionsCell(summary) {
    const cell = h("td", { class: "excluded" });
    const excluded = Object.entries(summary.excluded || {}).sort(([a], [b]) =>
      a < b ? -1 : a > b ? 1 : 0,
    );
    for (const [node, reason] of excluded) {
      cell.append(
        h("div", { class: "exclusion" }, h("span", { class: "mono" }, node), `: ${reason}`),
      );
    }
    // Payloads a node was handed but could not use (it says why in its report).
    for (const [reporter, report] of Object.entries(summary.reports || {})) {
      for (const [node, reason] of Object.entries(report.rejected || {})) {
        cell.append(
          h(
            "div",
            { class: "rejected" },
            h("span", { class: "mono" }, reporter),
            " rejected ",
            h("span", { class: "mono" }, node),
            `: ${reason}`,
          ),
        );
      }
    }
    if (!cell.childNodes.length) cell.append(h("span", { class: "muted" }, "none"));
    return cell;
  }

  function fingerprintCell(summary) {
    const a = agreement(summary);
    if (a.kind === "none") {
      return h("td", { class: "fingerprints" }, h("span", { class: "muted" }, "no reports yet"));
    }
    if (a.kind === "agree") {
      return h(
        "td",
        { class: "fingerprints agree", title: a.fingerprint },
        h("span", { class: "verdict" }, "agree"),
        ` · ${a.count} node${a.count === 1 ? "" : "s"} · `,
        h("span", { class: "mono" }, short(a.fingerprint)),
      );
    }
    return h(
      "td",
      { class: "fingerprints differ", title: `majority ${a.fingerprint}` },
      h("span", { class: "verdict" }, "differ"),
      ": ",
      nodeList(a.differ),
      ` vs ${a.count - a.differ.length} on `,
      h("span", { class: "mono" }, short(a.fingerprint)),
    );
  }

  function renderRounds(status) {
    const recent = (status.rounds || []).slice(-TABLE_ROUNDS).reverse();
    const inner = status.run.inner_steps;
    const rows = recent.map((r) => {
      const closed = r.state === "closed";
      const reports = reportsOf(r);
      const loss = mean(reports.map((x) => x.eval_loss));
      const up = reports.reduce((sum, x) => sum + (x.bytes_up || 0), 0);
      const down = reports.reduce((sum, x) => sum + (x.bytes_down || 0), 0);
      return h(
        "tr",
        { "data-round": r.round, "data-state": r.state },
        h("td", { class: "num round" }, String(r.round)),
        h("td", { class: "round-state" }, badge(r.state)),
        closed ? gatherCell(r, inner) : h("td", { class: "gather" }, "–"),
        closed ? exclusionsCell(r) : h("td", { class: "excluded" }, "–"),
        h("td", { class: "num bytes-up" }, reports.length ? bytes(up) : "–"),
        h("td", { class: "num bytes-down" }, reports.length ? bytes(down) : "–"),
        closed ? fingerprintCell(r) : h("td", { class: "fingerprints" }, "–"),
        h("td", { class: "num" }, loss === null ? "–" : loss.toFixed(4)),
        h(
          "td",
          { class: "num took" },
          seconds(r.duration_s),
          typeof r.budget_s === "number" ? h("span", { class: "muted" }, ` / ${seconds(r.budget_s)}`) : null,
        ),
      );
    });
    $("rounds").tBodies[0].replaceChildren(...rows);
    $("rounds").hidden = rows.length === 0;
    $("rounds-empty").hidden = rows.length !== 0;
  }

  // ---- the chart ----

  // About ``count`` round numbers (1, 2 or 5 times a power of ten) spanning [lo, hi].
  function ticks(lo, hi, count, integer) {
    const span = hi - lo || 1;
    const raw = span / count;
    const power = 10 ** Math.floor(Math.log10(raw));
    let step = [1, 2, 5, 10].map((m) => m * power).find((x) => x >= raw) || 10 * power;
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
      out.push(Number(v.toFixed(10)));
    }
    return { values: out, step };
  }

  // The rounds the run evaluates after, as RunConfig.evaluates says: the first, the last and
  // every eval_every-th. A run with eval_every = 10 has one point for its first 9 rounds: the
  // chart spans the whole run and marks the rounds still to come, so that reads as the plan.
  function evaluates(run, r) {
    const every = run.eval_every || 1;
    return r === 0 || r === run.rounds - 1 || (r + 1) % every === 0;
  }

  function cadence(run) {
    const every = run.eval_every || 1;
    if (every === 1) return "evaluated after every round";
    return `evaluated after the first round, every ${every}th and the last (eval_every = ${every})`;
  }

  function renderChart(run) {
    const box = $("loss-chart");
    const points = [...evalLoss].sort((a, b) => a[0] - b[0]);
    const planned = [];
    for (let r = 0; r < run.rounds; r++) {
      if (evaluates(run, r) && !evalLoss.has(r)) planned.push(r);
    }
    const next = planned.find((r) => !points.length || r > points[points.length - 1][0]);
    const plan = cadence(run) + (next === undefined ? "" : `; next: round ${next}`);
    if (!points.length) {
      box.replaceChildren(h("p", { class: "empty" }, "no evaluated rounds yet"));
      setText("loss-summary", plan);
      return;
    }
    const W = 560;
    const H = 250;
    const m = { left: 58, right: 16, top: 14, bottom: 44 };
    const xs = points.map(([r]) => r);
    const ys = points.map(([, y]) => y);
    const xlo = 0;
    const xhi = Math.max(Math.max(...xs), run.rounds - 1, 1);
    let ylo = Math.min(...ys);
    let yhi = Math.max(...ys);
    const pad = (yhi - ylo) * 0.08 || Math.abs(yhi) * 0.05 || 0.5;
    ylo -= pad;
    yhi += pad;
    const yt = ticks(ylo, yhi, 5, false);
    const xt = ticks(xlo, xhi, Math.min(8, xhi - xlo), true);
    const px = (r) => m.left + ((r - xlo) / (xhi - xlo)) * (W - m.left - m.right);
    const py = (y) => H - m.bottom - ((y - ylo) / (yhi - ylo)) * (H - m.top - m.bottom);
    const digits = Math.max(0, -Math.floor(Math.log10(yt.step)));

    const svg = s("svg", {
      viewBox: `0 0 ${W} ${H}`,
      class: "chart",
      role: "img",
      "aria-label": "eval loss over rounds",
    });
    for (const y of yt.values) {
      if (y < ylo || y > yhi) continue;
      svg.append(s("line", { class: "grid", x1: m.left, x2: W - m.right, y1: py(y), y2: py(y) }));
      svg.append(
        s("text", { class: "tick", x: m.left - 6, y: py(y) + 4, "text-anchor": "end" }, y.toFixed(digits)),
      );
    }
    for (const r of xt.values) {
      if (r < xlo || r > xhi) continue;
      svg.append(s("line", { class: "tickmark", x1: px(r), x2: px(r), y1: H - m.bottom, y2: H - m.bottom + 5 }));
      svg.append(s("text", { class: "tick", x: px(r), y: H - m.bottom + 18, "text-anchor": "middle" }, r));
    }
    svg.append(s("line", { class: "axis", x1: m.left, x2: m.left, y1: m.top, y2: H - m.bottom }));
    svg.append(s("line", { class: "axis", x1: m.left, x2: W - m.right, y1: H - m.bottom, y2: H - m.bottom }));
    svg.append(s("text", { class: "label", x: (m.left + W - m.right) / 2, y: H - 6, "text-anchor": "middle" }, "round"));
    svg.append(
      s("text", {
        class: "label",
        x: 14,
        y: (m.top + H - m.bottom) / 2,
        "text-anchor": "middle",
        transform: `rotate(-90 14 ${(m.top + H - m.bottom) / 2})`,
      }, "eval loss"),
    );
    svg.append(s("polyline", { class: "line", points: points.map(([r, y]) => `${px(r)},${py(y)}`).join(" ") }));
    for (const r of planned) {
      const mark = s("circle", { class: "planned", cx: px(r), cy: H - m.bottom, r: 3, "data-round": r });
      mark.append(s("title", {}, `round ${r}: evaluated when it closes`));
      svg.append(mark);
    }
    for (const [r, y] of points) {
      const dot = s("circle", { class: "point", cx: px(r), cy: py(y), r: 3.5, "data-round": r, "data-loss": y });
      dot.append(s("title", {}, `round ${r}: ${y.toFixed(4)}`));
      svg.append(dot);
    }
    box.replaceChildren(svg);
    const [r0, y0] = points[0];
    const [r1, y1] = points[points.length - 1];
    const shown =
      points.length === 1
        ? `round ${r0}: ${y0.toFixed(4)}`
        : `round ${r0}: ${y0.toFixed(4)} → round ${r1}: ${y1.toFixed(4)} (${points.length} rounds)`;
    setText("loss-summary", `${shown} · ${plan}`);
  }

  // ---- polling ----

  function render(status) {
    if (status.run_id !== runId) {
      runId = status.run_id;
      evalLoss.clear(); // another run behind the same address: start its history afresh
    }
    for (const r of status.rounds || []) {
      const loss = r.state === "closed" ? mean(reportsOf(r).map((x) => x.eval_loss)) : null;
      if (loss !== null) evalLoss.set(r.round, loss);
    }
    renderHeader(status);
    renderMembers(status);
    renderCheckpoint(status);
    renderRounds(status);
    renderChart(status.run);
  }

  function setConnection(ok, detail) {
    const c = $("connection");
    c.className = ok ? "connection ok" : "connection lost";
    c.textContent = ok
      ? `updated ${new Date().toLocaleTimeString()}`
      : `coordinator unreachable (${detail}); retrying`;
  }

  async function poll() {
    try {
      const rounds = fetched ? POLL_ROUNDS : FIRST_ROUNDS;
      const resp = await fetch(`/v1/status?rounds=${rounds}`, {
        cache: "no-store",
        headers: { Accept: "application/json" },
      });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      render(await resp.json());
      fetched = true;
      setConnection(true);
      document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
    } catch (err) {
      setConnection(false, err && err.message ? err.message : String(err));
    }
    window.setTimeout(poll, POLL_S * 1000);
  }

  setText("poll-every", String(POLL_S));
  poll();
})();
