# Regenerates jinja2_reference.json: chat templates rendered by Python Jinja2 configured as
# transformers does (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, Python tojson,
# raise_exception). Run: python3 gen_jinja2_reference.py (needs jinja2).
import json, jinja2, jinja2.sandbox
from jinja2.ext import loopcontrols
def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
def raise_exception(m): raise jinja2.exceptions.TemplateError(m)
env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters['tojson'] = tojson
env.globals['raise_exception'] = raise_exception
T = {}
T['llama_like'] = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
T['qwen_like'] = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
T['block_ws'] = """{% for m in messages %}
  {% if m.role == 'system' %}
    [SYS] {{ m.content }}
  {% elif m.role == 'user' %}
    [INST] {{ m.content | trim }} [/INST]
  {% else %}
    {{ m.content }}{{ eos_token }}
  {% endif %}
{% endfor %}
{{ {'n': messages|length, 'roles': messages|map(attribute='role')|list, 'note': 'é <b> & "q"'} | tojson }}
{% if add_generation_prompt %}[GEN]{% endif %}"""
msgs = [
  {"role": "system", "content": "  You are terse. Ünïcode ✓  "},
  {"role": "user", "content": " What is 2+2?\n"},
  {"role": "assistant", "content": "4"},
  {"role": "user", "content": "And 3+3?"},
]
out = {}
for k, src in T.items():
    out[k] = {"template": src, "rendered": env.from_string(src).render(messages=msgs, add_generation_prompt=True, bos_token="<|begin_of_text|>", eos_token="</s>")}
bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
try:
    env.from_string(T['llama_like']).render(messages=bad, add_generation_prompt=True, bos_token="<s>")
    out['alternate_error'] = None
except Exception as e:
    out['alternate_error'] = str(e)
json.dump({"messages": msgs, "cases": out}, open('jinja2_reference.json','w'), ensure_ascii=False, indent=1)
for k,v in out.items(): print(k, repr(v if isinstance(v,str) or v is None else v['rendered']))
