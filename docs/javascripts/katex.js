// Typesets the formulas that pymdownx.arithmatex (generic mode) marks: <span class="arithmatex">\(…\)</span>
// inline, <div class="arithmatex">\[…\]</div> displayed. KaTeX is vendored in docs/assets/katex, so the
// pages render their math without a network. Only arithmatex's elements are touched: a "$" in prose or
// code stays text.
document$.subscribe(() => {
  for (const el of document.querySelectorAll(".arithmatex")) {
    const tex = el.textContent.trim();
    const display = tex.startsWith("\\[");
    if (!display && !tex.startsWith("\\(")) continue;  // already typeset (instant navigation re-emits)
    try {
      katex.render(tex.slice(2, -2), el, {displayMode: display, throwOnError: true});
    } catch (error) {
      // A formula KaTeX cannot parse (an unknown macro too) keeps its TeX, marked, and the page's other
      // formulas still render; tests/docs/test_math.py fails on such a formula.
      el.textContent = tex;  // katex.render empties the element before it parses
      el.classList.add("katex-error");
      el.title = error.message;
      console.error(`KaTeX: ${error.message}`);
    }
  }
});
