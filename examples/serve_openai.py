"""Start ``shardwise serve`` on a model and query it with the ``openai`` client: a completion,
the same streamed, and a chat.

Run it with:  python examples/serve_openai.py [--model DIR]     (needs: pip install 'shardwise[serve]' openai)

Without ``--model`` it saves a small random Llama with a word-level tokenizer (no download):
the words are meaningless, but the server, the API and the client are the real ones. The
same server by hand:  shardwise serve DIR --port 8000  and  curl http://127.0.0.1:8000/v1/models
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def tiny_model(path: str) -> str:
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def start(model: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "serve", model, "--port", str(port)])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not start")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local Hugging Face model directory (default: a tiny Llama)")
    parser.add_argument("--prompt", default=None)
    args = parser.parse_args()
    import openai

    model = args.model or tiny_model(os.path.join(tempfile.mkdtemp(), "tiny-llama"))
    prompt = args.prompt or ("w5 w17 w9" if args.model is None else "The capital of France is")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start(model, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        print("completion:", repr(answer.choices[0].text), answer.usage)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        print("streamed:  ", repr("".join(chunk.choices[0].text for chunk in stream)))
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0
        )
        print("chat:      ", repr(chat.choices[0].message.content))
    finally:
        server.send_signal(signal.SIGTERM)  # running requests finish, then the server exits
        server.wait(60)


if __name__ == "__main__":
    main()
