"""The chat requests a draft model is distilled on: three kinds, none of them bench/speculative.py's own.

* free: a request answered from what the model knows (`FREE`: stories, explanations, advice, lists,
  letters, poems), where the reply copies nothing;
* passage: a passage of the text corpus (Tiny Shakespeare by default) to summarise, explain, rewrite
  or discuss, where the reply quotes and paraphrases its input;
* code: a function from the Python standard library's own source to rename a variable in, document,
  annotate or explain, where the reply gives most of the function back.

`chat_requests(n, text, rng)` draws n of them, the kinds in turn (free, passage, code, free, ...), each
the text of one user message; the caller renders it in the model's chat template.
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap

import numpy as np

FREE = (
    "Write a short story about a girl who builds a kite that can carry letters.",
    "Explain how a refrigerator keeps food cold.",
    "Give me five tips for sleeping better.",
    "Write a poem about the sea in winter.",
    "What is the difference between weather and climate?",
    "Write an email to a neighbour asking them to water my plants while I am away.",
    "Describe a busy market in a small town on a Saturday morning.",
    "How do vaccines train the immune system?",
    "Write a story about a robot who wants to learn to paint.",
    "List the planets of the solar system and one fact about each.",
    "Explain what a budget is and how to make one.",
    "Write a bedtime story about a bear who cannot find his hat.",
    "Why do leaves change colour in autumn?",
    "Give me a simple recipe for vegetable soup.",
    "What are the main causes of the French Revolution?",
    "Write a letter from a sailor to his family at home.",
    "Explain how to change a flat tyre on a bicycle.",
    "Describe the life cycle of a butterfly.",
    "Write a dialogue between a teacher and a student who forgot their homework.",
    "What makes a good friend? Answer in a short paragraph.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a story about two brothers who find a map in their attic.",
    "How does a bill become a law?",
    "Suggest a plan for learning a new language in six months.",
    "Write a short speech for the opening of a new library.",
    "What is the water cycle?",
    "Describe a thunderstorm from the point of view of a cat.",
    "Explain the rules of chess in a few sentences.",
    "Write a story about an old clockmaker and his apprentice.",
    "What are the benefits of regular exercise?",
    "Explain what a computer program is.",
    "Write a product description for a waterproof backpack.",
    "How do bees make honey?",
    "Write a story about a village that wakes up to find the river gone.",
    "Give three arguments for and three against school uniforms.",
    "Explain why the sky is blue.",
    "Write a thank-you note to a friend who helped me move house.",
    "Describe how bread is made, from wheat to loaf.",
    "Write a story about a train that runs through the night.",
    "What should I pack for a week of hiking in the mountains?",
)

PASSAGE_TASKS = (
    "Summarise the following text in a few sentences.",
    "Explain what happens in this scene.",
    "Rewrite this passage in plain modern English.",
    "Who speaks in this passage, and what does each of them want?",
    "Give this passage a title and explain your choice.",
)

CODE_TASKS = (
    "Rename the variable {old} to {new} in this Python function. Reply with the whole function.",
    "Add a docstring to this Python function. Reply with the whole function.",
    "Add type hints to this Python function. Reply with the whole function.",
    "Explain what this Python function does, step by step.",
)

# Standard-library modules whose functions are the code requests' material.
CODE_MODULES = ("textwrap", "shlex", "difflib", "fnmatch", "calendar", "colorsys", "statistics", "heapq",
                "bisect", "string", "html", "base64", "ipaddress", "fractions", "glob", "posixpath",
                "getopt", "csv", "json.encoder", "json.decoder", "configparser", "gettext", "quopri")
NEW_NAMES = ("result", "total", "current", "pieces", "answer", "buffer", "position", "found", "chunk", "counter")


def passage(text: str, rng: np.random.Generator, low: int = 500, high: int = 1100) -> str:
    """A run of whole lines of `text`, between about `low` and `high` characters, from a random line."""
    lines = text.splitlines()
    start = int(rng.integers(0, max(len(lines) - 1, 1)))
    want, taken = int(rng.integers(low, high + 1)), []
    for line in lines[start:]:
        if taken and sum(len(t) + 1 for t in taken) + len(line) > want:
            break
        taken.append(line)
    return "\n".join(taken).strip() or text[:high]


def library_functions(min_lines: int = 8, max_lines: int = 35) -> list[str]:
    """The source of every function (methods included) of `CODE_MODULES` between `min_lines` and `max_lines`
    lines, dedented, in a fixed order."""
    found = []
    for name in CODE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin, encoding="utf-8") as handle:
            source = handle.read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                found.append(textwrap.dedent(ast.get_source_segment(source, node, padded=True)).rstrip() + "\n")
    return found


def local_names(code: str) -> list[str]:
    """The names a function assigns to (its locals and loop variables), longest first, each once."""
    names = {node.id for node in ast.walk(ast.parse(code))
             if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    return sorted(names, key=lambda n: (-len(n), n))


def code_request(code: str, rng: np.random.Generator) -> str:
    """A request about `code`: a rename of one of its locals (when it has one) or another of `CODE_TASKS`."""
    task = CODE_TASKS[int(rng.integers(len(CODE_TASKS)))]
    olds = local_names(code)
    if "{old}" in task and olds:
        old = olds[int(rng.integers(len(olds)))]
        new = next((n for n in rng.permutation(NEW_NAMES) if n not in code), f"{old}_value")
        task = task.format(old=old, new=new)
    elif "{old}" in task:
        task = CODE_TASKS[1]
    return f"{task}\n\n```python\n{code}```"


def chat_requests(n: int, text: str, rng: np.random.Generator) -> list[str]:
    """n user messages, the kinds in turn (free, passage, code), each drawn at random (the free ones without
    repeats until all have been used)."""
    free = [FREE[i] for i in rng.permutation(len(FREE))]
    functions = library_functions() or [textwrap.dedent(FALLBACK_FUNCTION)]
    requests = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            requests.append(free[(i // 3) % len(free)])
        elif kind == 1:
            task = PASSAGE_TASKS[int(rng.integers(len(PASSAGE_TASKS)))]
            requests.append(f"{task}\n\n{passage(text, rng)}")
        else:
            requests.append(code_request(functions[int(rng.integers(len(functions)))], rng))
    return requests


FALLBACK_FUNCTION = '''\
def mean_of(values):
    total = 0.0
    count = 0
    for value in values:
        total = total + value
        count = count + 1
    if count == 0:
        return None
    return total / count
'''
