"""Chat templates with the logic of three released model families, written here from how those
templates behave (nothing is downloaded; the wording of system and tool prompts is our own).

What each reproduces, because it is what trips a training pipeline up:

* ``LLAMA3_TEMPLATE`` (Llama-3.1 behaviour): writes ``bos_token`` itself (and the tokenizer's
  post-processor adds one too: tokenizing the rendered text with special tokens doubles it); always
  opens with a system block carrying "Cutting Knowledge Date" and "Today Date" lines, the user's
  system text appended; with ``tools`` the tool list goes into the first user message by default
  (``tools_in_user_message``) or the system block; an assistant tool call renders as a JSON object
  (``{"name": ..., "parameters": ...}``) instead of the message's content, one call per message;
  ``tool`` results render under the ``ipython`` role; every turn ends with ``<|eot_id|>``; the
  assistant's content is trimmed.
* ``QWEN3_TEMPLATE`` (Qwen3 behaviour): ChatML turns; tools listed in the system turn inside
  ``<tools>``; ``reasoning_content`` (or a ``<think>...</think>`` prefix of the content) renders as a
  think block only for assistant turns after the last real user query, and the last turn always
  gets one (empty when there is no reasoning), so rendering a longer conversation rewrites the
  earlier turns; tool calls render as ``<tool_call>`` JSON blocks; consecutive ``tool`` replies are
  wrapped in ``<tool_response>`` inside one user turn; ``enable_thinking=false`` makes the generation
  prompt an empty think block.
* ``MISTRAL_TEMPLATE`` (Mistral-Instruct behaviour, the double-BOS family): the tokenizer adds
  ``<s>`` and the template writes ``bos_token`` too; user turns are ``[INST] ... [/INST]`` with the
  system text prepended to the first one; there is no generation prompt (the model writes its answer
  straight after ``[/INST]``); an assistant turn is a space, the trimmed content and ``</s>``; tool
  calls render as ``[TOOL_CALLS]`` JSON and results as ``[TOOL_RESULTS]`` JSON.
"""

from __future__ import annotations

LLAMA3_TEMPLATE = r"""
{{- bos_token }}
{%- set ns = namespace(tools=none, date='26 Jul 2024', in_user=true) %}
{%- if tools is defined and tools %}{%- set ns.tools = tools %}{%- endif %}
{%- if date_string is defined %}{%- set ns.date = date_string %}{%- endif %}
{%- if tools_in_user_message is defined %}{%- set ns.in_user = tools_in_user_message %}{%- endif %}
{%- set system_text = '' %}
{%- set rest = messages %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system_text = messages[0].content | trim %}
    {%- set rest = messages[1:] %}
{%- endif %}
{%- macro tool_list() %}
    {{- 'To call one of the functions below, answer with only a JSON object of the form '
        '{"name": <function name>, "parameters": <object of argument names and values>}. '
        'Use literal values, no variables.\n\n' }}
    {%- for t in ns.tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}
{%- endmacro %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if ns.tools is not none %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + ns.date + '\n\n' }}
{%- if ns.tools is not none and not ns.in_user %}{{- tool_list() }}{%- endif %}
{{- system_text + '<|eot_id|>' }}
{%- if ns.tools is not none and ns.in_user %}
    {%- if not rest %}{{- raise_exception('tools go into the first user message, and there is none') }}{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- tool_list() }}
    {{- (rest[0].content | trim) + '<|eot_id|>' }}
    {%- set rest = rest[1:] %}
{%- endif %}
{%- for m in rest %}
    {%- if m.role == 'tool' or m.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if m.content is mapping %}{{- m.content | tojson }}{%- else %}{{- m.content }}{%- endif %}
        {{- '<|eot_id|>' }}
    {%- elif m.tool_calls is defined and m.tool_calls %}
        {%- if m.tool_calls | length != 1 %}{{- raise_exception('one tool call per assistant message') }}{%- endif %}
        {%- set call = m.tool_calls[0] %}
        {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}' }}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

QWEN3_TEMPLATE = r"""
{%- set ns = namespace(last_query=messages | length - 1, searching=true, thought='', text='') %}
{%- if tools is defined and tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nThese functions are available. Their signatures are inside <tools></tools>:\n<tools>' }}
    {%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nTo call a function, write a JSON object with its name and arguments inside '
        '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        '</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages | reverse %}
    {%- if ns.searching and m.role == 'user' and m.content is string
           and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}
        {%- set ns.searching = false %}
        {%- set ns.last_query = (messages | length) - loop.index %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- set ns.text = m.content if m.content is string else '' %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + ns.text + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set ns.thought = '' %}
        {%- if m.reasoning_content is string %}
            {%- set ns.thought = m.reasoning_content %}
        {%- elif '</think>' in ns.text %}
            {%- set ns.thought = ns.text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set ns.text = ns.text.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or ns.thought) %}
            {{- '<|im_start|>assistant\n<think>\n' + ns.thought.strip('\n') + '\n</think>\n\n' + ns.text.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + ns.text }}
        {%- endif %}
        {%- if m.tool_calls is defined and m.tool_calls %}
            {%- for call in m.tool_calls %}
                {%- if not loop.first or ns.text %}{{- '\n' }}{%- endif %}
                {%- set fn = call.function if call.function is defined else call %}
                {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
                {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + ns.text + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

MISTRAL_TEMPLATE = r"""
{%- set ns = namespace(first_user=true) %}
{%- set system_text = '' %}
{%- set rest = messages %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system_text = messages[0].content %}
    {%- set rest = messages[1:] %}
{%- endif %}
{{- bos_token }}
{%- for m in rest %}
    {%- if m.role == 'user' %}
        {%- if ns.first_user and tools is defined and tools %}
            {{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {%- if ns.first_user and system_text %}
            {{- '[INST] ' + system_text + '\n\n' + m.content + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + m.content + '[/INST]' }}
        {%- endif %}
        {%- set ns.first_user = false %}
    {%- elif m.role == 'assistant' and m.tool_calls is defined and m.tool_calls %}
        {{- '[TOOL_CALLS] [' }}
        {%- for call in m.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '{"name": "' + fn.name + '", "arguments": ' + (fn.arguments | tojson) + '}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif m.role == 'assistant' %}
        {{- ' ' + (m.content | trim) + eos_token }}
    {%- elif m.role == 'tool' %}
        {{- '[TOOL_RESULTS] {"content": ' + (m.content | tojson) + '}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('roles after the first message must be user, assistant or tool, got ' + m.role) }}
    {%- endif %}
{%- endfor %}
"""

SMOLLM2_TEMPLATE = r"""
{%- for message in messages %}
    {%- if loop.first and messages[0].role != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
"""SmolLM2-Instruct behaviour: ChatML turns, a default system turn when the conversation has none;
tools, tool calls and reasoning are not rendered (the message content only)."""

GPT2_CHAT_TEMPLATE = r"""
{%- for message in messages %}
    {{- message.role | capitalize + ': ' + message.content + '\n\n' }}
    {%- if message.role == 'assistant' %}{{- eos_token }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}
"""
"""A GPT-2-era chat fine-tune: plain-text role prefixes, the one special token (``<|endoftext|>``,
BOS, EOS and UNK at once) closing each assistant turn."""
