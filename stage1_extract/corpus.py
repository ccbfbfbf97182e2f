"""The embedded default prompt set, built from a corpus that ships with Python (`pydoc_data.topics`).

A few hundred user prompts of varied length (short questions and long documentation excerpts),
deterministic for a given count, so the default run needs no download and no data of its own.
"""

from __future__ import annotations

import random
from pathlib import Path

from shared.conversations import Conversation
from stage1_extract.data import write_conversations_parquet

_ASKS = (
    "Explain this part of the Python reference in plain words:\n\n{text}",
    "Summarize the following documentation in three sentences:\n\n{text}",
    "Give a short code example that illustrates this:\n\n{text}",
    "What is the most important point in this passage?\n\n{text}",
)
_QUESTIONS = (
    "What does the Python topic '{topic}' cover? Answer briefly.",
    "Write one tip for a beginner about '{topic}' in Python.",
    "When would a programmer use {topic} in Python?",
)


def is_question(i: int, question_share: float) -> bool:
    """Prompt i of the default set is a short question: spread evenly, share 0.25 = every 4th (i % 4 == 3)."""
    return int((i + 1) * question_share + 1e-9) > int(i * question_share + 1e-9)


def default_conversations(count: int, seed: int = 0, question_share: float = 0.25) -> list[Conversation]:
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    names = sorted(topics)
    paragraphs = [
        (name, p.strip())
        for name in names
        for p in topics[name].split("\n\n")
        if 200 <= len(p.strip()) <= 1200
    ]
    rng.shuffle(paragraphs)
    conversations = []
    for i in range(count):
        if is_question(i, question_share):
            # short questions keep the length distribution wide, as real chat data is
            prompt = _QUESTIONS[i % len(_QUESTIONS)].format(topic=names[i % len(names)].replace("-", " "))
        else:
            topic, text = paragraphs[i % len(paragraphs)]
            prompt = _ASKS[i % len(_ASKS)].format(text=text)
        conversations.append(Conversation(row=i, messages=[{"role": "user", "content": prompt}], source="pydoc"))
    return conversations


def write_default_prompts(path: Path, count: int, question_share: float = 0.25) -> Path:
    write_conversations_parquet(default_conversations(count, question_share=question_share), path)
    return path
