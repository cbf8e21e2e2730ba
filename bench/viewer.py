"""How fast the attention viewer's page opens: the 1024-token page of the baby model in headless Chromium.

    PYTHONPATH=$PWD python bench/viewer.py [--checkpoint DIR] [--data PATH] [--loads 5]
    PYTHONPATH=$PWD python bench/viewer.py --screenshots [--screenshot-checkpoint DIR]

The page (`jaxattn.viewer.model_attention_page`) of configs/shakespeare_char_baby.toml (4 layers x 4
heads, RoPE, max_seq_len raised to 1024; random init from --seed unless --checkpoint) over the first
1024 characters of Tiny Shakespeare (--data, else $JAXATTN_SHAKESPEARE, else train.data.corpus's cache). It is
opened --loads times, each in a fresh offline browser context of Debian's Chromium driven by Playwright
(tests/browser.py: every request recorded and aborted; the run fails on any, or on a console error).
Measured in the page: milliseconds from navigation start to `document.body.dataset.ready == "1"` (an
init script's MutationObserver notes the moment), and, once ready, from an input event to the frame
after it: hovering a query token (head view), opening the model view, clicking a thumbnail (matrix
view) and hovering a matrix cell. Medians over the loads, with the file size (and gzipped, for
reference). Writes bench/results/viewer.json and viewer.md with the CPU, Chromium's version and the
command.

--screenshots instead saves the three views of a ~60-character page of the baby GQA model
(configs/shakespeare_char_baby_gqa.toml; random init unless --screenshot-checkpoint) to
docs/viewer_head.png (a query token hovered), docs/viewer_model.png and docs/viewer_matrix.png.
"""

from __future__ import annotations

import argparse
import gzip
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import describe_machine, portable_command, write_results  # noqa: E402
from bench.timing import median, seconds  # noqa: E402
from tests.browser import OfflinePage, launch, missing  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
TOKENS = 1024
SCREENSHOT_CHARS = 60
PATH_FLAGS = ("--checkpoint", "--data", "--screenshot-checkpoint", "--out", "--page")
# Notes the moment the page declares itself drawn (performance.now(): ms since navigation start).
MARK_READY = """(() => {
  const mark = () => {
    if (window.__readyMs === undefined && document.body && document.body.dataset.ready === '1')
      window.__readyMs = performance.now();
  };
  new MutationObserver(mark).observe(document, {subtree: true, attributes: true, attributeFilter: ['data-ready']});
})();"""
# Arms a one-shot listener: ms from the next `type` event to the end of the frame after it.
ARM = """(type) => { window.__frame = new Promise(resolve => document.addEventListener(type, () => {
  const start = performance.now();
  requestAnimationFrame(() => setTimeout(() => resolve(performance.now() - start), 0));
}, {capture: true, once: true})); }"""
# Arms a one-shot click listener: ms from the click to every thumbnail in the viewport drawn (polled each frame).
ARM_THUMBS = """() => { window.__thumbs = new Promise(resolve => document.addEventListener('click', () => {
  const start = performance.now(), ink = INK;
  const inView = (c) => { const r = c.getBoundingClientRect();
    return r.bottom > 0 && r.top < innerHeight && r.right > 0 && r.left < innerWidth; };
  const check = () => Array.from(document.querySelectorAll('canvas.thumb')).filter(inView).every(c => ink(c) > 0)
    ? resolve(performance.now() - start) : requestAnimationFrame(check);
  requestAnimationFrame(check);
}, {capture: true, once: true})); }"""
INK = """(c) => { const ctx = c.getContext('2d'); if (!ctx || !c.width || !c.height) return 0;
  const d = ctx.getImageData(0, 0, c.width, c.height).data; let n = 0;
  for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }"""


def model_and_tokens(config_name: str, checkpoint: str | None, data: str | None, seed: int, length: int):
    """(model config, params, ids, token strings, where the params came from): `length` characters of the corpus."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jaxattn.model import DecoderLM
    from train.config import load_config
    from train.data.corpus import load_corpus, read_text, resolve_data_path
    from train.models.runs import load_for_sampling

    if checkpoint:
        params, config, tokenizer = load_for_sampling(checkpoint)
        source = f"checkpoint {Path(checkpoint).name}"
    else:
        experiment = load_config(config_name)
        config, tokenizer = experiment.model, load_corpus(data, tokenizer=experiment.train.tokenizer).tokenizer
        params = None
        source = f"random init (seed {seed})"
    if config.max_seq_len < length:
        if config.positions == "learned":
            sys.exit(f"error: {source} has learned positions for {config.max_seq_len} tokens, fewer than {length}")
        config = config.replace(max_seq_len=length)  # RoPE/sinusoidal/none: the params do not depend on it
    if params is None:
        params = nn.unbox(DecoderLM(config).init(jax.random.PRNGKey(seed), jnp.zeros((1, 2), jnp.int32))["params"])
    ids = [int(i) for i in tokenizer.encode(read_text(resolve_data_path(data)))[:length]]
    return config, params, ids, [tokenizer.decode([i]) for i in ids], source


def frame_after(page, event: str, action) -> float:
    """Milliseconds from the `event` that `action` causes to the end of the next frame."""
    page.evaluate(ARM, event)
    action()
    return page.evaluate("() => window.__frame")


def one_load(browser, path: Path, T: int) -> dict:
    view = OfflinePage(browser)
    view.context.add_init_script(MARK_READY)
    try:
        page, wall = seconds(lambda: view.open(path, timeout_ms=60_000))
        page.wait_for_function("() => window.__readyMs !== undefined", timeout=10_000)
        timing = page.evaluate("""() => { const n = performance.getEntriesByType('navigation')[0];
            const p = performance.getEntriesByName('first-contentful-paint')[0];
            return {ready: window.__readyMs, dom_content_loaded: n.domContentLoadedEventEnd, load: n.loadEventEnd,
                    first_contentful_paint: p ? p.startTime : null}; }""")
        t = T // 2
        timing["hover_query"] = frame_after(page, "mousemove", lambda: page.hover(f".token.query[data-index='{t}']"))
        page.evaluate(ARM_THUMBS.replace("INK", INK))
        timing["model_view"] = frame_after(page, "click", lambda: page.click("#tab-model"))
        timing["thumbnails_in_view"] = page.evaluate("() => window.__thumbs")
        thumb = "canvas.thumb[data-layer='0'][data-head='0']"
        timing["thumbnail_to_matrix"] = frame_after(page, "click", lambda: page.click(thumb))
        box = page.locator("#matrix-canvas").bounding_box()
        cell = {"x": box["width"] * 0.3, "y": box["height"] * 0.6}
        page.hover("#matrix-canvas", position={"x": 1, "y": 1})
        timing["hover_matrix"] = frame_after(page, "mousemove", lambda: page.hover("#matrix-canvas", position=cell))
        timing["wall_to_ready"] = wall * 1e3
        view.assert_clean()
        return timing
    finally:
        view.close()


def screenshots(browser, args) -> list[Path]:
    import numpy as np

    from jaxattn.viewer import model_attention_page
    from train.attention_maps import attention_weights

    config, params, ids, tokens, source = model_and_tokens(
        "shakespeare_char_baby_gqa", args.screenshot_checkpoint, args.data, args.seed, SCREENSHOT_CHARS)
    html = model_attention_page(config, params, ids, tokens, title=f"baby GQA model ({source})")
    view = OfflinePage(browser, viewport=(1200, 800))
    paths = [DOCS / f"viewer_{name}.png" for name in ("head", "model", "matrix")]
    try:
        with tempfile.TemporaryDirectory() as folder:
            page = view.open_html(html, folder)
            page.hover(f".token.query[data-index='{len(tokens) - 4}']")
            page.wait_for_timeout(200)
            page.screenshot(path=str(paths[0]), full_page=True)
            page.click("#tab-model")
            page.wait_for_function(f"() => Array.from(document.querySelectorAll('canvas.thumb')).every(c => ({INK})(c) > 0)",
                                   timeout=10_000)
            page.screenshot(path=str(paths[1]), full_page=True)
            page.click(f"canvas.thumb[data-layer='{config.num_layers - 1}'][data-head='1']")
            box = page.locator("#matrix-canvas").bounding_box()
            q = len(tokens) - 4  # the row hovered in the head view, at its strongest earlier key
            k = int(np.argmax(attention_weights(params, config, ids)[config.num_layers - 1, 1, q, :q]))
            page.hover("#matrix-canvas", position={"x": (k + 0.5) * box["width"] / len(tokens),
                                                   "y": (q + 0.5) * box["height"] / len(tokens)})
            page.wait_for_timeout(200)
            page.screenshot(path=str(paths[2]), full_page=True)
            view.assert_clean()
    finally:
        view.close()
    for path in paths:
        print(f"wrote {path.relative_to(ROOT)}")
    return paths


def markdown(record: dict) -> str:
    page, med = record["page"], record["median_ms"]
    lines = [
        f"# Attention viewer: the {page['tokens']}-token page of the baby model in headless Chromium",
        "",
        f"{page['layers']} layers x {page['heads']} heads, {page['tokens']} characters of Tiny Shakespeare, "
        f"{record['params']}; {record['loads']} loads, each in a fresh offline context (every request blocked: "
        f"none made, no console error).",
        "",
        "| | median | all loads |",
        "| --- | ---: | --- |",
    ]
    names = {"ready": "navigation start to `dataset.ready == \"1\"` (ms)",
             "dom_content_loaded": "navigation start to DOMContentLoaded (ms)",
             "first_contentful_paint": "first contentful paint (ms)",
             "wall_to_ready": "`goto` to ready seen by Playwright (ms)",
             "hover_query": "hover a query token (head view) to the next frame (ms)",
             "model_view": "open the model view (16 thumbnails) to the next frame (ms)",
             "thumbnails_in_view": "open the model view to every thumbnail in view drawn (ms)",
             "thumbnail_to_matrix": "click a thumbnail to the matrix view's frame (ms)",
             "hover_matrix": "hover a matrix cell to the next frame (ms)"}
    for key, name in names.items():
        if med.get(key) is not None:
            runs = ", ".join("-" if x is None else f"{x:.0f}" for x in record["loads_ms"][key])
            lines.append(f"| {name} | {med[key]:.0f} | {runs} |")
    lines += [
        "",
        f"File: {page['bytes']:,} bytes ({page['bytes'] / 2**20:.1f} MiB), built in {page['build_s']:.1f} s by `jaxattn.viewer.model_attention_page` (including the "
        f"weights' compile and run).",
        "",
        f"Chromium {record['chromium']} (Debian's package) through Playwright {record['playwright']}, headless; "
        f"{record['machine']['cpu']} ({record['machine']['cpus']} CPUs).",
        "",
        f"Made by: `{record['command']}`",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a run's out_dir (default: random init of the baby config)")
    parser.add_argument("--data", help="Tiny Shakespeare (default: $JAXATTN_SHAKESPEARE or train.data.corpus's cache)")
    parser.add_argument("--seed", type=int, default=0, help="of the random init")
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--page", help="also keep the 1024-token page at this path")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--screenshots", action="store_true", help="save docs/viewer_*.png instead")
    parser.add_argument("--screenshot-checkpoint", help="with --screenshots: a trained run of the GQA config")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if (reason := missing()) is not None:
        sys.exit(f"error: {reason}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            if args.screenshots:
                screenshots(browser, args)
                return
            run(browser, args)
        finally:
            browser.close()


def run(browser, args) -> None:
    from importlib.metadata import version

    from jaxattn.viewer import model_attention_page

    config, params, ids, tokens, source = model_and_tokens("shakespeare_char_baby", args.checkpoint, args.data,
                                                           args.seed, TOKENS)
    html, build = seconds(lambda: model_attention_page(config, params, ids, tokens,
                                                       title=f"baby model, {len(ids)} characters ({source})"))
    data = html.encode("utf-8")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(args.page) if args.page else Path(folder) / "viewer_1024.html"
        path.write_bytes(data)
        loads = [one_load(browser, path, len(ids)) for _ in range(args.loads)]
    keys = list(loads[0])
    record = {
        "page": {"tokens": len(ids), "layers": config.num_layers, "heads": config.num_heads, "bytes": len(data),
                 "gzip_bytes": len(gzip.compress(data, 6)), "build_s": build},
        "params": source, "loads": args.loads,
        "median_ms": {k: median(x[k] for x in loads) for k in keys},
        "loads_ms": {k: [x[k] for x in loads] for k in keys},
        "chromium": browser.version, "playwright": version("playwright"),
        "machine": describe_machine(),
        "command": ("PYTHONPATH=$PWD python bench/viewer.py " + portable_command(args.argv, PATH_FLAGS)).strip(),
    }
    write_results(args.out, "viewer", record, markdown(record))


if __name__ == "__main__":
    main()
