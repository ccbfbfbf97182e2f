"""Qwen3's tool-call turns: its template opens the last assistant turn with an empty think block and
drops it from a turn without reasoning once any turn follows (a tool call before its result)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from stage1_extract.template import tokenize_conversation

# Qwen3-8B's chat template (tokenizer_config.json, as published), verbatim.
QWEN3 = "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0].role == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n    {%- if message.content is string %}\n        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = '' %}\n    {%- endif %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n        {%- if message.reasoning_content is string %}\n            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n            {%- if '</think>' in content %}\n                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n            {%- endif %}\n        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n            {%- if loop.last or (not loop.last and reasoning_content) %}\n                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n                {%- endif %}\n                {%- if tool_call.function %}\n                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n                    {{- tool_call.arguments }}\n                {%- else %}\n                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- content }}\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}\n"

TOOLS = json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
CALL = {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]}
ROW = [{"role": "user", "content": "Weather in Paris?"}, CALL, {"role": "tool", "content": "sunny"},
       {"role": "assistant", "content": "It is sunny."}]


@pytest.fixture
def qwen3(tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = QWEN3
    return tokenizer


def pieces(tokenizer, *parts):
    """Ids of the (text, supervised) parts' joined text, and the mask: a token supervised when it starts
    in a supervised part (no token here crosses a part's edge)."""
    text, ranges = "", []
    for part, supervised in parts:
        ranges.append((len(text), len(text) + len(part), supervised))
        text += part
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [next(sup for a, b, sup in ranges if a <= start < b) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


@pytest.mark.parametrize("thinking", [None, False], ids=["default", "enable_thinking=false"])
def test_a_tool_call_without_reasoning_is_supervised_as_the_later_turns_see_it(qwen3, thinking):
    """Refused as "not prefix-stable" (advising a {% generation %} template the code never reads): every
    non-thinking agentic row was dropped. The call's JSON and its closing are supervised where the whole
    conversation has them (without the think block its render as a last turn opens with)."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    sample = tokenize_conversation(qwen3, ROW, 4096, TOOLS, kwargs)
    system = qwen3.apply_chat_template(ROW[:1], tools=json.loads(TOOLS), tokenize=False).split("<|im_start|>user")[0]
    ids, mask = pieces(
        qwen3,
        (system + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n", False),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n', True),
        # Under enable_thinking=false the last turn's empty think block is its generation prompt's.
        ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
         + ("" if thinking is None else "<think>\n\n</think>\n\n"), False),
        (("<think>\n\n</think>\n\n" if thinking is None else "") + "It is sunny.<|im_end|>\n", True),
    )
    assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == mask
    assert sample.context_turns == 0 and not sample.truncated


def test_a_turn_whose_reasoning_the_history_drops_is_refused_naming_a_way_forward(qwen3):
    """A call whose reasoning a later turn drops (a template that keeps it on the last turn only) cannot be
    supervised; the refusal names what to do, not a {% generation %} template this code never reads."""
    qwen3.chat_template = QWEN3.replace("(not loop.last and reasoning_content)", "false")
    row = [ROW[0], {**CALL, "reasoning_content": "I need the weather."}, *ROW[2:]]
    with pytest.raises(ValueError) as refused:
        tokenize_conversation(qwen3, row, 4096, TOOLS)
    assert str(refused.value) == (
        "chat template is not prefix-stable at assistant turn 1: the conversation rendered up to that turn is not how "
        "the whole conversation renders it, so its tokens cannot be told apart; end the row after that turn (a row "
        "ending at it masks), or set data.on_bad_row=skip to skip such rows")


def test_an_earlier_answer_without_reasoning_is_supervised_not_context(qwen3):
    """The same opening dropped before a later user query: the turn was kept as unsupervised context,
    though its text and closing are in the sequence as it wrote them."""
    row = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."},
           {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6."}]
    sample = tokenize_conversation(qwen3, row, 512)
    ids, mask = pieces(qwen3, ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", False), ("4.<|im_end|>\n", True),
                       ("<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n", False),
                       ("<think>\n\n</think>\n\n6.<|im_end|>\n", True))
    assert sample.input_ids.tolist() == ids and sample.loss_mask.tolist() == mask and sample.context_turns == 0
