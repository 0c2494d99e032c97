"use strict";
// The page served by `aiayn serve`: translate lines of text with POST /translate and draw the
// encoder-decoder attention it returns (return_attention with full_attention: cross is
// (L, H, T, S) nested lists; when that is over the server's limit, the last layer's head
// average, mean, (T, S)).
// Plain DOM, no libraries, no build step; relative URLs, so it works behind a path prefix.
// Everything that comes from the user or the model is inserted as text, never as HTML.

const $ = (id) => document.getElementById(id);

const state = {
  texts: [], // the source lines sent
  translations: [], // the server's answer, one per line
  sentence: 0, // which translation the heatmap shows
};

// An error clears the previous result, so that it is never read as the answer to this request.
function setStatus(message, isError = false) {
  const status = $("status");
  status.textContent = message;
  status.classList.toggle("error", isError);
  if (isError) clearResult();
}

function clearResult() {
  state.texts = [];
  state.translations = [];
  state.sentence = 0;
  $("translations").replaceChildren();
  $("heatmap").replaceChildren();
  $("attention").hidden = true;
}

function formatCount(n) {
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
  if (n >= 1e3) return `${(n / 1e3).toFixed(1)}k`;
  return String(n);
}

function element(tag, { text, className, title } = {}) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (className) node.className = className;
  if (title) node.title = title;
  return node;
}

async function loadInfo() {
  try {
    const response = await fetch("info");
    const info = await response.json();
    const { source, target } = info.languages;
    const model = info.model;
    $("model-info").textContent =
      `${source.name} → ${target.name} · ${formatCount(info.parameters)} parameters · ` +
      `${model.n_encoder_layers}+${model.n_decoder_layers} layers, ${model.n_heads} heads, ` +
      `d_model ${model.d_model}`;
    $("beam-size").value = info.decoding.beam_size;
    $("beam-size").max = info.limits.max_beam_size;
    $("n-best").max = info.limits.max_beam_size;
  } catch (error) {
    $("model-info").textContent = `model information unavailable (${error})`;
  }
}

async function translate() {
  const texts = $("source").value.split("\n").map((line) => line.trim()).filter((line) => line);
  if (texts.length === 0) {
    setStatus("Type a sentence first.", true);
    return;
  }
  const request = {
    texts,
    beam_size: Number($("beam-size").value) || null,
    n_best: Number($("n-best").value) || null,
    return_attention: true,
    full_attention: true,
  };
  const button = $("translate");
  button.disabled = true;
  setStatus("Translating…");
  const started = performance.now();
  try {
    let response = await post(request);
    let answer = await response.json();
    if (response.status === 413 && String(answer.error).includes("--max-attention-values")) {
      response = await post({ ...request, full_attention: false }); // the average is smaller
      answer = await response.json();
    }
    if (response.status === 422 && String(answer.error).includes("no attention maps")) {
      response = await post({ ...request, return_attention: false }); // e.g. CTranslate2
      answer = await response.json();
    }
    if (!response.ok) {
      setStatus(answer.error || `the server answered ${response.status}`, true);
      return;
    }
    state.texts = texts;
    state.translations = answer.translations.map(withCross);
    state.sentence = 0;
    renderTranslations();
    renderControls();
    renderHeatmap();
    const ms = Math.round(performance.now() - started);
    setStatus(`${texts.length} ${texts.length === 1 ? "sentence" : "sentences"} in ${ms} ms`);
  } catch (error) {
    setStatus(`the request failed: ${error}`, true);
  } finally {
    button.disabled = false;
  }
}

function post(request) {
  return fetch("translate", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(request),
  });
}

// Only the head average came back: shown as one layer with one head.
function withCross(translation) {
  const attention = translation.attention;
  if (attention && !attention.cross) attention.cross = [[attention.mean]];
  return translation;
}

function renderTranslations() {
  const list = $("translations");
  list.replaceChildren();
  state.translations.forEach((translation, i) => {
    const item = element("li", { title: state.texts[i] });
    item.dataset.index = i;
    item.append(element("span", { text: translation.text || "(empty)", className: "text" }));
    if (translation.truncated) {
      item.append(element("span", { text: " (source truncated)", className: "muted" }));
    }
    if (translation.hypotheses.length > 1) {
      const nbest = element("ol", { className: "nbest" });
      for (const hypothesis of translation.hypotheses) {
        const entry = element("li");
        entry.append(element("span", { text: hypothesis.text || "(empty)" }));
        const score = hypothesis.score === null ? "–" : hypothesis.score.toFixed(3);
        entry.append(element("span", { text: score, className: "score", title: "score" }));
        nbest.append(entry);
      }
      item.append(nbest);
    }
    item.addEventListener("click", () => selectSentence(i));
    list.append(item);
  });
  markSelected();
}

function markSelected() {
  for (const item of $("translations").children) {
    item.classList.toggle("selected", Number(item.dataset.index) === state.sentence);
  }
}

function selectSentence(i) {
  state.sentence = i;
  $("sentence").value = String(i);
  markSelected();
  renderHeatmap();
}

function fillSelect(select, options, selected) {
  select.replaceChildren();
  for (const [value, label] of options) {
    const option = element("option", { text: label });
    option.value = value;
    select.append(option);
  }
  select.value = selected;
}

function renderControls() {
  const attention = state.translations[0] && state.translations[0].attention;
  if (!attention) return;
  const layers = attention.cross.length;
  const heads = attention.cross[0].length;
  const sentences = state.texts.map((text, i) => {
    const short = text.length > 40 ? `${text.slice(0, 39)}…` : text;
    return [String(i), `${i + 1}: ${short}`];
  });
  fillSelect($("sentence"), sentences, "0");
  $("sentence").disabled = sentences.length < 2;
  const layer = Number($("layer").value);
  const keepLayer = $("layer").options.length === layers && layer >= 0;
  fillSelect(
    $("layer"),
    [...Array(layers).keys()].map((l) => [String(l), `${l + 1} of ${layers}`]),
    String(keepLayer ? layer : layers - 1),
  );
  const head = $("head").value;
  const keepHead = $("head").options.length === heads + 1 && head !== "";
  const headChoices = [...Array(heads).keys()].map((h) => [String(h), `head ${h + 1}`]);
  fillSelect(
    $("head"),
    [["mean", `average of ${heads} heads`], ...headChoices],
    keepHead ? head : "mean",
  );
}

// (T, S) matrix of one layer: one head, or the mean over heads.
function attentionMatrix(cross, layer, head) {
  const maps = cross[layer]; // (H, T, S)
  if (head !== "mean") return maps[Number(head)];
  return maps[0].map((row, t) =>
    row.map((_, s) => maps.reduce((sum, map) => sum + map[t][s], 0) / maps.length),
  );
}

// White (0) to the accent blue (1), linear in the weight.
function color(weight) {
  const w = Math.min(Math.max(weight, 0), 1);
  const mix = (from, to) => Math.round(from + (to - from) * w);
  return `rgb(${mix(255, 31)}, ${mix(255, 95)}, ${mix(255, 191)})`;
}

function renderHeatmap() {
  const section = $("attention");
  const translation = state.translations[state.sentence];
  const attention = translation && translation.attention;
  if (!attention) {
    section.hidden = true;
    return;
  }
  section.hidden = false;
  const matrix = attentionMatrix(attention.cross, Number($("layer").value), $("head").value);
  const { src_tokens: source, tgt_tokens: output } = attention;

  const table = element("table");
  const header = element("tr");
  header.append(element("th", { className: "corner" }));
  source.forEach((piece, s) => {
    header.append(element("th", { text: piece, className: "src", title: `source ${s}: ${piece}` }));
  });
  table.append(element("thead"));
  table.tHead.append(header);

  const body = element("tbody");
  output.forEach((piece, t) => {
    const row = element("tr");
    const label = element("th", { text: piece, className: "tgt", title: `output ${t}: ${piece}` });
    label.tabIndex = 0;
    label.addEventListener("focus", () => highlight(table, matrix, t));
    row.append(label);
    matrix[t].forEach((weight, s) => {
      const cell = element("td", { title: `${piece} → ${source[s]}: ${weight.toFixed(3)}` });
      cell.style.background = color(weight);
      row.append(cell);
    });
    row.addEventListener("mouseenter", () => highlight(table, matrix, t));
    body.append(row);
  });
  table.append(body);
  table.addEventListener("mouseleave", () => highlight(table, matrix, null));
  $("heatmap").replaceChildren(table);
}

// Shows which source tokens output token t attends to: column headers shaded by its weights,
// the most attended one outlined; t = null clears.
function highlight(table, matrix, t) {
  table.tBodies[0].querySelectorAll("tr").forEach((row, i) => {
    row.classList.toggle("active", i === t);
  });
  const headers = table.tHead.querySelectorAll("th.src");
  const weights = t === null ? null : matrix[t];
  const best = weights ? weights.indexOf(Math.max(...weights)) : -1;
  headers.forEach((th, s) => {
    th.style.background = weights ? color(weights[s]) : "";
    th.style.color = weights && weights[s] > 0.5 ? "white" : "";
    th.classList.toggle("aligned", s === best);
  });
}

$("translate").addEventListener("click", translate);
$("source").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) translate();
});
$("sentence").addEventListener("change", () => selectSentence(Number($("sentence").value)));
$("layer").addEventListener("change", renderHeatmap);
$("head").addEventListener("change", renderHeatmap);
loadInfo();
