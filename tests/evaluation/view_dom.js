// Runs the script of a page `eogym-sft view` wrote against a minimal DOM, for machines without a browser (CI):
// node view_dom.js PAGE.html [HASH] prints, as JSON, per run its host's total and shown counts, each filter's
// options, and what choosing each option shows; and the columns of the compare overlay.
"use strict";
const fs = require("fs");

class El {
  constructor(tag) {
    this.tag = tag; this.className = ""; this.textContent = ""; this.dataset = {}; this.style = {};
    this.children = []; this.listeners = {}; this.value = ""; this.parent = null;
    const classes = new Set();
    this.classList = { add: (c) => classes.add(c), remove: (c) => classes.delete(c), has: (c) => classes.has(c) };
  }
  appendChild(child) { child.parent = this; this.children.push(child); return child; }
  append(...kids) { kids.forEach((k) => this.appendChild(k)); }
  replaceChildren(...kids) { this.children = []; this.append(...kids); }
  remove() { if (this.parent) this.parent.children = this.parent.children.filter((c) => c !== this); }
  addEventListener(type, fn) { (this.listeners[type] = this.listeners[type] || []).push(fn); }
  fire(type) { (this.listeners[type] || []).forEach((fn) => fn.call(this, { stopPropagation() {} })); }
  click() { this.fire("click"); }
  scrollIntoView() {}
  querySelector(selector) {  // only ".ep:nth-child(N) .ep-head", as the script asks
    const n = Number(/nth-child\((\d+)\)/.exec(selector)[1]);
    return this.children[n - 1].children[0];
  }
  all(predicate, out = []) { this.children.forEach((c) => { if (predicate(c)) out.push(c); c.all(predicate, out); }); return out; }
}

const [page, hash] = [fs.readFileSync(process.argv[2], "utf8"), process.argv[3] || ""];
const data = /<script type="application\/json" id="eogym-data">([\s\S]*?)<\/script>/.exec(page)[1];
const code = /<script nonce="[^"]*">([\s\S]*?)<\/script>/.exec(page)[1];
const hosts = [...page.matchAll(/<div class="episodes" data-run="(\d+)"><\/div>/g)].map((m) => {
  const host = new El("div"); host.dataset.run = m[1]; return host;
});
const byId = { "eogym-data": { textContent: data }, overlay: new El("div"), compare: new El("div") };
const document = {
  createElement: (tag) => new El(tag),
  getElementById: (id) => byId[id],
  querySelectorAll: () => hosts,
  addEventListener() {},
  body: { dataset: {} },
};
new Function("document", "location", code)(document, { hash });

const report = hosts.map((host) => {
  const count = host.all((e) => e.className === "count")[0];
  const problems = host.all((e) => e.className === "problems").map((e) => e.textContent);
  if (!count) return { problems };
  const filters = host.all((e) => e.tag === "select").map((select) => {
    const choices = select.children.map((option) => {
      select.value = option.value; select.fire("change");
      return [option.textContent, Number(count.dataset.shown)];
    });
    select.value = ""; select.fire("change");
    return choices;
  });
  return { total: Number(count.dataset.total), shown: Number(count.dataset.shown), filters, problems };
});
const columns = byId.compare.all((e) => e.className === "col").map((col) => col.all((e) => e.tag === "b")[0].textContent);
console.log(JSON.stringify({ ready: document.body.dataset.ready === "1", runs: report, compare: columns }));
