// Markdown for model output, rendered as DOM nodes built with createElement and text nodes only: no HTML is ever
// parsed, so markup in the text (a <script>, an <img onerror>) stays text. Links are made for http(s) URLs only.
//
// The subset models use: fenced code blocks, headings, paragraphs, block quotes, lists (nested), tables, rules;
// inline code, bold, italic, strikethrough, links and bare URLs. An unterminated code fence (a reply still
// streaming) runs to the end of the text.

const MAX_DEPTH = 12;  // nesting of quotes, lists and emphasis rendered as such; deeper text stays plain
const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( {0,12})([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
const TABLE_RULE = /^ {0,3}\|?\s*:?-+:?\s*(?:\|\s*:?-+:?\s*)*\|?\s*$/;
const BLANK = /^\s*$/;
// Inline spans, earliest match first: code, link, bare URL, bold, bold, strikethrough, italic, italic, escape.
const INLINE = new RegExp([
  "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)",
  "\\[([^\\]\\n]*)\\]\\(\\s*<?([^)\\s>]*)>?(?:\\s+\"[^\"\\n]*\")?\\s*\\)",
  "(https?:\\/\\/[^\\s<>\"'`]*[^\\s<>\"'`.,;:!?)\\]])",
  "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",
  "(?<![\\w])__(?=\\S)([\\s\\S]*?\\S)__(?![\\w])",
  "~~(?=\\S)([\\s\\S]*?\\S)~~",
  "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*(?!\\*)",
  "(?<![\\w])_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?![\\w])",
  "\\\\([\\\\`*_{}\\[\\]()#+\\-.!~|>])",
].join("|"), "g");

/** The Markdown `text` as a DocumentFragment. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  renderBlocks(String(text).replace(/\r\n?/g, "\n").split("\n"), fragment, 0);
  return fragment;
}

/** An http(s) URL as its normalized string, or null for anything else (javascript:, data:, relative). */
export function safeUrl(raw) {
  let url;
  try {
    url = new URL(raw);
  } catch {
    return null;
  }
  return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
}

function node(tag, ...children) {
  const element = document.createElement(tag);
  element.append(...children);
  return element;
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST_ITEM.test(line);
}

function renderBlocks(lines, parent, depth) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (BLANK.test(line)) {
      i++;
      continue;
    }
    let m = FENCE.exec(line);
    if (m) {
      const close = new RegExp(`^ {0,3}${m[1][0] === "`" ? "`" : "~"}{${m[1].length},}\\s*$`);
      const body = [];
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      i++;
      parent.append(codeBlock(body.join("\n"), m[2]));
      continue;
    }
    if (depth >= MAX_DEPTH) {
      parent.append(node("p", lines.slice(i).join("\n")));
      return;
    }
    if ((m = HEADING.exec(line))) {
      const heading = node(`h${m[1].length}`);
      renderInline(m[2] || "", heading, depth);
      parent.append(heading);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      parent.append(node("hr"));
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && !BLANK.test(lines[i]); i++) {
        const q = QUOTE.exec(lines[i]);
        quoted.push(q ? q[1] : lines[i]);
      }
      const quote = node("blockquote");
      renderBlocks(quoted, quote, depth + 1);
      parent.append(quote);
      continue;
    }
    if (LIST_ITEM.test(line)) {
      i = renderList(lines, i, parent, depth);
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      i = renderTable(lines, i, parent, depth);
      continue;
    }
    const paragraph = [line.trim()];
    for (i++; i < lines.length && !BLANK.test(lines[i]) && !startsBlock(lines[i]); i++) paragraph.push(lines[i].trim());
    const p = node("p");
    renderInline(paragraph.join("\n"), p, depth);
    parent.append(p);
  }
}

function renderList(lines, i, parent, depth) {
  const first = LIST_ITEM.exec(lines[i]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = node(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  while (i < lines.length) {
    const m = LIST_ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const contentIndent = indent + m[2].length + 1;
    const item = [m[3] || ""];
    for (i++; i < lines.length; i++) {
      const line = lines[i];
      if (BLANK.test(line)) {
        // A blank line continues the item only when the next line is indented into it.
        if (i + 1 < lines.length && !BLANK.test(lines[i + 1]) && indentOf(lines[i + 1]) > indent) {
          item.push("");
          continue;
        }
        break;
      }
      const marker = LIST_ITEM.exec(line);
      if (marker && marker[1].length <= indent) break;
      if (!marker && indentOf(line) <= indent && startsBlock(line)) break;
      item.push(line.slice(Math.min(indentOf(line), contentIndent)));
    }
    const li = node("li");
    renderBlocks(item, li, depth + 1);
    list.append(li);
    let next = i;
    while (next < lines.length && BLANK.test(lines[next])) next++;
    const following = next < lines.length ? LIST_ITEM.exec(lines[next]) : null;
    if (!following || following[1].length !== indent || /\d/.test(following[2]) !== ordered) break;
    i = next;
  }
  parent.append(list);
  return i;
}

function tableCells(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function renderTable(lines, i, parent, depth) {
  const aligns = tableCells(lines[i + 1]).map((cell) =>
    cell.endsWith(":") ? (cell.startsWith(":") ? "center" : "right") : "");
  const row = (line, tag) => {
    const tr = node("tr");
    tableCells(line).forEach((text, column) => {
      const cell = node(tag);
      if (aligns[column]) cell.style.textAlign = aligns[column];
      renderInline(text, cell, depth);
      tr.append(cell);
    });
    return tr;
  };
  const body = node("tbody");
  let j = i + 2;
  for (; j < lines.length && !BLANK.test(lines[j]) && lines[j].includes("|"); j++) body.append(row(lines[j], "td"));
  const wrap = node("div", node("table", node("thead", row(lines[i], "th")), body));
  wrap.className = "table-wrap";
  parent.append(wrap);
  return j;
}

function codeBlock(text, language) {
  const code = node("code", text);
  if (language) code.dataset.language = language;
  const pre = node("pre", code);
  pre.className = "code";
  return pre;
}

function renderInline(text, parent, depth) {
  if (depth >= MAX_DEPTH) {
    parent.append(text);
    return;
  }
  const pattern = new RegExp(INLINE.source, "g");
  let last = 0;
  for (let m = pattern.exec(text); m; m = pattern.exec(text)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    last = m.index + m[0].length;
    if (m[1] !== undefined) {
      // Inner spaces at both ends are dropped when both are there, as CommonMark says.
      const inner = /^ [\s\S]*[^ ][\s\S]* $/.test(m[2]) ? m[2].slice(1, -1) : m[2];
      parent.append(node("code", inner));
    } else if (m[3] !== undefined) {
      const href = safeUrl(m[4]);
      if (href === null) {
        parent.append(m[0]);
      } else {
        parent.append(link(href, m[3] || m[4], depth));
      }
    } else if (m[5] !== undefined) {
      const href = safeUrl(m[5]);
      parent.append(href === null ? m[5] : link(href, m[5], depth, true));
    } else if (m[6] !== undefined || m[7] !== undefined) {
      parent.append(inline("strong", m[6] ?? m[7], depth));
    } else if (m[8] !== undefined) {
      parent.append(inline("del", m[8], depth));
    } else if (m[9] !== undefined || m[10] !== undefined) {
      parent.append(inline("em", m[9] ?? m[10], depth));
    } else {
      parent.append(m[11]);
    }
  }
  if (last < text.length) parent.append(text.slice(last));
}

function inline(tag, text, depth) {
  const element = node(tag);
  renderInline(text, element, depth + 1);
  return element;
}

function link(href, text, depth, plain = false) {
  const a = node("a");
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  if (plain) a.append(text);
  else renderInline(text, a, depth + 1);
  return a;
}
