"use strict";
// The episode browser and the same task over time. Episode text is untrusted model output: it
// only ever reaches the page through textContent, never as markup.
(function () {
  const episodes = JSON.parse(document.getElementById("episodes-data").textContent);
  const PAGE = 25;
  const ANY = "";

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function num(x, digits) {
    return typeof x === "number" ? x.toFixed(digits) : "–";
  }

  function outcome(ep) {
    return (ep.success ? "✓ success" : "✗ fail") + " · score " + num(ep.score, 2);
  }

  function headline(ep) {
    const turns = Array.isArray(ep.turns) ? ep.turns.length : 0;
    return ["step " + ep.step, ep.split, ep.category, "task " + ep.task_id, "sample " + ep.sample,
      ep.status, outcome(ep), turns + " turn" + (turns === 1 ? "" : "s")].join(" · ");
  }

  function block(label, text, cls) {
    const wrap = el("div", "field " + (cls || ""));
    wrap.appendChild(el("span", "label", label));
    wrap.appendChild(el("pre", null, text));
    return wrap;
  }

  function renderTurn(turn, index) {
    const node = el("div", "turn");
    const tokens = turn.tokens === undefined ? "" : " · " + turn.tokens + " tokens";
    node.appendChild(el("div", "turn-head", "turn " + (index + 1) + " · reward " + num(turn.reward, 2) + tokens));
    node.appendChild(block("reply", turn.text, "reply"));
    const action = el("div", "field");
    if (turn.action) {
      action.appendChild(el("span", "label", "action"));
      action.appendChild(el("code", "action", turn.action));
    }
    if (turn.action_error) {
      action.appendChild(el("span", "label", "no action"));
      action.appendChild(el("span", "action-error", turn.action_error));
    }
    if (!turn.action && !turn.action_error) action.appendChild(el("span", "label", "no action parsed"));
    node.appendChild(action);
    if (turn.observation === null || turn.observation === undefined) {
      node.appendChild(el("div", "field muted", "no observation followed (the episode ended here)"));
    } else {
      node.appendChild(block("observation", turn.observation, "obs"));
    }
    return node;
  }

  function renderEpisode(ep) {
    const body = el("div", "episode-body");
    const tokens = ep.tokens || {};
    const facts = ["env " + ep.env, "group " + ep.group, "weights v" + ep.weight_version,
      "tokens " + tokens.prompt + " prompt / " + tokens.response + " sampled / " + tokens.total + " total",
      num(ep.time_s, 2) + " s"];
    body.appendChild(el("div", "facts-line", facts.join(" · ")));
    if (ep.error) body.appendChild(el("div", "action-error", "error: " + ep.error));
    body.appendChild(block("task", ep.observation, "obs first"));
    (ep.turns || []).forEach(function (turn, i) { body.appendChild(renderTurn(turn, i)); });
    return body;
  }

  // A <details> whose body is built the first time it opens: a few thousand episodes stay cheap.
  function episodeCard(ep, summaryText) {
    const card = el("details", "episode " + (ep.success ? "ok" : "fail"));
    card.appendChild(el("summary", null, summaryText));
    card.addEventListener("toggle", function () {
      if (card.open && card.childNodes.length === 1) card.appendChild(renderEpisode(ep));
    });
    return card;
  }

  let haystacks = null;
  function haystack(i) {
    if (!haystacks) haystacks = new Array(episodes.length);
    if (haystacks[i] === undefined) {
      const ep = episodes[i];
      const parts = [ep.observation, ep.error, ep.category, "task " + ep.task_id];
      (ep.turns || []).forEach(function (t) { parts.push(t.text, t.action, t.action_error, t.observation); });
      haystacks[i] = parts.filter(function (p) { return p; }).join("\n").toLowerCase();
    }
    return haystacks[i];
  }

  const FILTERS = {
    step: function (ep) { return String(ep.step); },
    split: function (ep) { return String(ep.split); },
    category: function (ep) { return String(ep.category); },
    status: function (ep) { return String(ep.status); },
    success: function (ep) { return ep.success ? "yes" : "no"; },
  };

  function fillSelect(select, values) {
    select.appendChild(el("option", null, "any")).value = ANY;
    values.forEach(function (v) { select.appendChild(el("option", null, v)).value = v; });
  }

  function distinct(key) {
    const values = Array.from(new Set(episodes.map(FILTERS[key])));
    const numeric = values.every(function (v) { return v !== "" && !isNaN(Number(v)); });
    return values.sort(numeric ? function (a, b) { return a - b; } : undefined);
  }

  function setUpBrowser() {
    const list = document.getElementById("ep-list");
    if (!list) return;
    Object.keys(FILTERS).forEach(function (key) { fillSelect(document.getElementById("f-" + key), distinct(key)); });
    const text = document.getElementById("f-text");
    const count = document.getElementById("ep-count");
    let matching = [];
    let page = 0;

    function show() {
      list.replaceChildren();
      const first = page * PAGE;
      matching.slice(first, first + PAGE).forEach(function (i) {
        list.appendChild(episodeCard(episodes[i], headline(episodes[i])));
      });
      const last = Math.min(first + PAGE, matching.length);
      count.textContent = matching.length + " of " + episodes.length + " episodes match" +
        (matching.length ? "; showing " + (first + 1) + "–" + last : "");
      count.dataset.matching = String(matching.length);
      document.getElementById("ep-prev").disabled = page === 0;
      document.getElementById("ep-next").disabled = last >= matching.length;
    }

    function apply() {
      const chosen = {};
      Object.keys(FILTERS).forEach(function (key) { chosen[key] = document.getElementById("f-" + key).value; });
      const needle = text.value.trim().toLowerCase();
      matching = [];
      episodes.forEach(function (ep, i) {
        for (const key in chosen) if (chosen[key] !== ANY && FILTERS[key](ep) !== chosen[key]) return;
        if (needle && haystack(i).indexOf(needle) < 0) return;
        matching.push(i);
      });
      page = 0;
      show();
    }

    Object.keys(FILTERS).forEach(function (key) { document.getElementById("f-" + key).addEventListener("change", apply); });
    text.addEventListener("input", apply);
    document.getElementById("ep-prev").addEventListener("click", function () { page -= 1; show(); });
    document.getElementById("ep-next").addEventListener("click", function () { page += 1; show(); });
    document.getElementById("expand-all").addEventListener("click", function () {
      list.querySelectorAll("details.episode").forEach(function (d) { d.open = true; });
    });
    apply();
  }

  function setUpOverTime() {
    const select = document.getElementById("t-task");
    const grid = document.getElementById("t-grid");
    const tasks = new Map();
    episodes.forEach(function (ep) {
      if (ep.split !== "eval") return;
      const key = [ep.env, ep.task_id, ep.category].join("\u0000");
      if (!tasks.has(key)) tasks.set(key, {ep: ep, byStep: new Map()});
      const byStep = tasks.get(key).byStep;
      if (!byStep.has(ep.step)) byStep.set(ep.step, []);
      byStep.get(ep.step).push(ep);
    });
    if (!tasks.size) {
      select.parentNode.hidden = true;
      document.getElementById("t-none").hidden = false;
      return;
    }
    const steps = Array.from(new Set(episodes.filter(function (e) { return e.split === "eval"; })
      .map(function (e) { return e.step; }))).sort(function (a, b) { return a - b; });
    function rate(task, step) {
      const eps = task.byStep.get(step) || [];
      return eps.length ? eps.filter(function (e) { return e.success; }).length / eps.length : null;
    }
    function change(task) {
      const rates = steps.map(function (s) { return rate(task, s); }).filter(function (r) { return r !== null; });
      return rates.length ? Math.abs(rates[rates.length - 1] - rates[0]) : 0;
    }
    const ordered = Array.from(tasks.values()).sort(function (a, b) { return change(b) - change(a); });
    ordered.forEach(function (task, i) {
      const rates = steps.map(function (s) {
        const r = rate(task, s);
        return r === null ? "–" : Math.round(100 * r) + "%";
      });
      const label = "task " + task.ep.task_id + " (" + task.ep.category + "): success " + rates.join(" → ");
      select.appendChild(el("option", null, label)).value = String(i);
    });

    function show() {
      const task = ordered[Number(select.value)];
      const table = el("table", "over-time");
      const head = table.appendChild(el("tr"));
      const row = table.appendChild(el("tr"));
      steps.forEach(function (step) {
        head.appendChild(el("th", null, "step " + step));
        const cell = row.appendChild(el("td"));
        const eps = (task.byStep.get(step) || []).slice().sort(function (a, b) { return a.sample - b.sample; });
        if (!eps.length) cell.appendChild(el("p", "muted", "not evaluated at this step"));
        eps.forEach(function (ep) {
          const turns = (ep.turns || []).length;
          cell.appendChild(episodeCard(ep, "sample " + ep.sample + " · " + ep.status + " · " + outcome(ep) +
            " · " + turns + " turns"));
        });
      });
      grid.replaceChildren(table);
    }
    select.addEventListener("change", show);
    show();
  }

  setUpBrowser();
  setUpOverTime();
})();
