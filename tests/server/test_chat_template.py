"""Chat templates end to end (issue 42, item 5): a model directory whose tokenizer_config.json
has a chat_template (ChatML here) is served with it: the chat prompt's token count is that of
the template's text, written out by hand from ChatML's meaning and tokenized by the server's
/tokenize; OpenAI's `developer` role is the system role; a template's raise_exception is a 400
naming the problem and the server keeps serving; --chat-template FILE (Zephyr's template, whose
text holds </s>) takes the place of the model's, its </s> text becoming the EOS id; without
either, LLaMA-2's compiled-in template; a --chat-template that does not parse stops the start
with the file and the line; vLLM's chat_template_kwargs become the template's variables (a
Qwen3-style enable_thinking, through a template written with a macro; over HTTP and over gRPC,
where they are a google.protobuf.Struct), and anything but an object is a 400 naming the
parameter. Run: /usr/bin/python3 test_chat_template.py --build B"""
import json
import os
import shutil
import tempfile

from harness import HAVE_KJV, KJV, ROOT, Server, check, compile_protos, run

TMP = tempfile.mkdtemp(prefix="burst-chat-template-")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "chat_templates")
CHATML_STRICT = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def model_with_template():
    d = os.path.join(TMP, "chatml-model")
    os.makedirs(d)
    for f in ("config.json", "model.safetensors", "tokenizer.model"):
        shutil.copyfile(os.path.join(KJV, f), os.path.join(d, f))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML_STRICT}, f)
    return d


def count(srv, text):
    st, r = srv.json("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    check(st == 200, f"/tokenize: {st} {r}")
    return r["count"]


def chat(srv, messages):
    return srv.json("POST", "/v1/chat/completions",
                    {"messages": messages, "max_tokens": 2, "temperature": 0})


def test_model_template():
    with Server("--model", model_with_template(), workers=1) as srv:
        st, r = chat(srv, [{"role": "developer", "content": "Be brief."},
                           {"role": "user", "content": "Who begat Enos?"}])
        check(st == 200, f"HTTP {st}: {r}")
        text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho begat Enos?"
                "<|im_end|>\n<|im_start|>assistant\n")
        check(r["usage"]["prompt_tokens"] == count(srv, text),
              f"prompt_tokens {r['usage']['prompt_tokens']}, ChatML's text {count(srv, text)}")
        # The template refuses a role: 400 with its words, and the server serves on.
        st, r = chat(srv, [{"role": "tool", "content": "x"}])
        check(st == 400 and r["error"]["message"] == "Unknown role: tool", f"{st}: {r}")
        st, r = chat(srv, [{"role": "user", "content": "And God said"}])
        check(st == 200 and r["choices"][0]["finish_reason"] == "length", f"{st}: {r}")


def test_chat_template_flag():
    path = os.path.join(FIXTURES, "zephyr.jinja")
    with Server("--model", model_with_template_dir(), "--chat-template", path, workers=1) as srv:
        st, r = chat(srv, [{"role": "system", "content": "S"},
                           {"role": "user", "content": "In the beginning"}])
        check(st == 200, f"HTTP {st}: {r}")
        # Zephyr: each turn ends with </s>, the EOS id, one token each; the rest is text.
        want = (count(srv, "<|system|>\nS") + 1 + count(srv, "\n<|user|>\nIn the beginning") + 1
                + count(srv, "\n<|assistant|>\n"))
        check(r["usage"]["prompt_tokens"] == want,
              f"prompt_tokens {r['usage']['prompt_tokens']}, Zephyr's text {want}")


def test_bad_template_file_refused_at_start():
    """A --chat-template that does not parse stops the start with the file and the line."""
    path = os.path.join(TMP, "bad.jinja")
    with open(path, "w") as f:
        f.write("{% for m in messages %}\n{{ m.content }}\n")  # no endfor
    try:
        Server("--chat-template", path, workers=1)
    except RuntimeError as e:
        log = str(e)
        check(path in log and "line 3" in log and "endfor" in log, log[-2000:])
        return
    raise AssertionError("the server started with a template that does not parse")


# Qwen3's way with enable_thinking (an empty think block when it is false), a macro per turn, and
# a variable that is an object.
THINKING = (
    "{%- macro turn(role, content) -%}"
    "{{ '<|im_start|>' ~ role ~ '\\n' ~ content ~ '<|im_end|>\\n' }}"
    "{%- endmacro -%}"
    "{%- for m in messages %}{{ turn(m.role, m.content) }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
    "{%- if persona is defined %}{{ persona.name ~ ':' }}{% endif %}")


def test_chat_template_kwargs():
    path = os.path.join(TMP, "thinking.jinja")
    with open(path, "w") as f:
        f.write(THINKING)
    msgs = [{"role": "user", "content": "Who begat Enos?"}]
    base = "<|im_start|>user\nWho begat Enos?<|im_end|>\n<|im_start|>assistant\n"
    with Server("--model", model_with_template_dir(), "--chat-template", path, workers=1) as srv:
        for kwargs, text in [(None, base), ({"enable_thinking": True}, base),
                             ({"enable_thinking": False}, base + "<think>\n\n</think>\n\n"),
                             ({"persona": {"name": "Moses"}, "unused": [1, None]},
                              base + "Moses:")]:
            body = {"messages": msgs, "max_tokens": 1, "temperature": 0}
            if kwargs is not None:
                body["chat_template_kwargs"] = kwargs
            st, r = srv.json("POST", "/v1/chat/completions", body)
            check(st == 200 and r["usage"]["prompt_tokens"] == count(srv, text),
                  f"{kwargs}: {st} {r} (the text: {count(srv, text)} tokens)")
        # Anything but an object, and an object that would replace the conversation: 400s that
        # name the parameter.
        for bad, word in [(5, "must be an object"), (["enable_thinking"], "must be an object"),
                          ({"messages": []}, "must not set 'messages'")]:
            st, r = srv.json("POST", "/v1/chat/completions",
                             {"messages": msgs, "max_tokens": 1, "chat_template_kwargs": bad})
            check(st == 400 and r["error"]["param"] == "chat_template_kwargs" and
                  word in r["error"]["message"], f"{bad}: {st} {r}")
        # Completions have no template: the parameter is unknown there.
        st, r = srv.json("POST", "/v1/completions",
                         {"prompt": "x", "max_tokens": 1, "chat_template_kwargs": {}})
        check(st == 400 and r["error"]["param"] == "chat_template_kwargs", f"{st} {r}")
        grpc_chat_template_kwargs(srv, base)


def grpc_chat_template_kwargs(srv, base):
    """gRPC's ChatRequest.chat_template_kwargs (a google.protobuf.Struct) gives the template the
    same variables as HTTP's JSON, and the same refusal for `messages`."""
    import grpc
    from google.protobuf import struct_pb2
    compile_protos("burst/v1/burst.proto")
    from burst.v1 import burst_pb2, burst_pb2_grpc
    stub = burst_pb2_grpc.BurstStub(grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}"))
    msgs = [burst_pb2.ChatMessage(role="user", content="Who begat Enos?")]
    thinking_off = base + "<think>\n\n</think>\n\n"
    for kwargs, text in [(None, base), ({"enable_thinking": False}, thinking_off),
                         ({"enable_thinking": True}, base),
                         ({"persona": {"name": "Moses"}, "unused": [1, None]}, base + "Moses:")]:
        req = burst_pb2.ChatRequest(messages=msgs, max_tokens=1)
        if kwargs is not None:
            s = struct_pb2.Struct()
            s.update(kwargs)
            req.chat_template_kwargs.CopyFrom(s)
        events = list(stub.Chat(req, timeout=60))
        got = events[0].started.prompt_tokens
        check(got == count(srv, text), f"gRPC {kwargs}: {got} prompt tokens, the text has "
              f"{count(srv, text)}")
    bad = burst_pb2.ChatRequest(messages=msgs, max_tokens=1)
    bad.chat_template_kwargs.update({"messages": []})
    try:
        list(stub.Chat(bad, timeout=60))
        check(False, "gRPC chat_template_kwargs with 'messages' was accepted")
    except grpc.RpcError as e:
        check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "must not set 'messages'" in
              e.details(), f"gRPC 'messages' in chat_template_kwargs: {e.code()} {e.details()}")


def model_with_template_dir():
    d = os.path.join(TMP, "chatml-model")
    return d if os.path.isdir(d) else model_with_template()


def test_compiled_in_llama2():
    with Server(workers=1) as srv:  # kjv-tiny has no tokenizer_config.json
        st, r = chat(srv, [{"role": "developer", "content": "Be brief."},
                           {"role": "user", "content": "Who begat Enos?"}])
        check(st == 200, f"HTTP {st}: {r}")
        # BOS + "[INST] <<SYS>>\n...\n<</SYS>>\n\nWho begat Enos? [/INST]"
        text = "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWho begat Enos? [/INST]"
        check(r["usage"]["prompt_tokens"] == 1 + count(srv, text),
              f"prompt_tokens {r['usage']['prompt_tokens']}, LLaMA-2's {1 + count(srv, text)}")


if __name__ == "__main__":
    if not HAVE_KJV:
        print("needs models/kjv-tiny")
        raise SystemExit(77)
    try:
        run([test_model_template, test_chat_template_flag, test_chat_template_kwargs,
             test_compiled_in_llama2, test_bad_template_file_refused_at_start])
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
