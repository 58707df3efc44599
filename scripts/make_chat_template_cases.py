"""Writes tests/fixtures/chat_templates/expected.json: each template of that folder rendered
with jinja2 as transformers renders chat templates (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, raise_exception) over a few conversations. The C++ interpreter
(server/common/jinja.cpp) is tested against these texts in tests/unit/chat_template_test.cpp; jinja2
is needed here only, never at run time. Run: python3 scripts/make_chat_template_cases.py"""
import json
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                    "fixtures", "chat_templates")

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Who begat Enos?"}],
    "system_user": [{"role": "system", "content": "  Answer briefly.\n"},
                    {"role": "user", "content": "Who begat Enos? "}],
    "multi_turn": [{"role": "system", "content": "Be kind."},
                   {"role": "user", "content": "In the beginning"},
                   {"role": "assistant", "content": " God created the heaven "},
                   {"role": "user", "content": "and the earth? xyz"}],
    "two_users": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "unicode": [{"role": "user", "content": "Ünïcødé \u2014 \U0001F600 'quotes' \"dq\""}],
}


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    cases = []
    for name in sorted(os.listdir(HERE)):
        if not name.endswith(".jinja"):
            continue
        template = env.from_string(open(os.path.join(HERE, name)).read())
        for conv, messages in CONVERSATIONS.items():
            for gen in (True, False):
                case = {"template": name, "conversation": conv, "add_generation_prompt": gen}
                try:
                    case["text"] = template.render(messages=messages, bos_token="<s>",
                                                   eos_token="</s>",
                                                   add_generation_prompt=gen)
                except jinja2.exceptions.TemplateError as e:
                    case["error"] = str(e)
                cases.append(case)
    out = {"conversations": CONVERSATIONS, "cases": cases}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
