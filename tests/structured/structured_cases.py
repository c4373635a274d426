"""What the structured-output tests share: a Hermes-style chat template written by hand from the published format
(it lists tools and renders tool calls and results), the JSON schemas completions are held to, and two tools."""

HERMES_TEMPLATE = (
    "{%- if tools %}<s>system: You may call these functions. Put each call in <tool_call></tool_call> tags:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}</s>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') %}<s>assistant: {{ m['content'] or '' }}"
    "{%- for call in m['tool_calls'] %}<tool_call>\n{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}\n</tool_call>{%- endfor %}</s>"
    "{%- elif m['role'] == 'tool' %}<s>tool: <tool_response>\n{{ m['content'] }}\n</tool_response></s>"
    "{%- else %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<s>assistant:{%- endif %}")

# Nested objects, arrays, enums, numbers with bounds, required fields, strings with patterns. Strings are bounded:
# a random model closes an unbounded string only by chance.
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"}},
        "required": ["name", "age", "email"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[0-9]{4}-[A-Z]{2}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"enum": ["A1", "B2", "C3"]},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]},
        "total": {"type": "number", "minimum": 0, "maximum": 1000}},
        "required": ["id", "items", "status"], "additionalProperties": False},
    "flags": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "level": {"enum": [1, 2, 3]},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 2}},
        "required": ["on", "level", "point", "tags"], "additionalProperties": False},
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]$"}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
# Added to the test tokenizer (conftest.py): the first two not special, the others special.
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]


def strict(tools: list[dict]) -> list[dict]:
    return [{**t, "function": {**t["function"], "strict": True}} for t in tools]
