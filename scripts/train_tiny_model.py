"""Train nanoserve's bundled tiny chat model (a Llama-architecture model that calls a calculator).

    python scripts/train_tiny_model.py                 # writes nanoserve/assets/
    python scripts/train_tiny_model.py --steps 300 --out /tmp/tiny   # a quick smoke run
    python scripts/train_tiny_model.py --layers 2 --steps 2500 --tokenizer nanoserve/assets \
        --save-dtype bfloat16 --out nanoserve/assets/draft    # the draft model for speculative decoding

Everything is generated here from fixed seeds: synthetic chat data, a byte-level BPE tokenizer, the
model, and a held-out evaluation of 50 arithmetic / letter-counting prompts run through the tool loop.
See scripts/TRAINING.md for the hardware, run time and results of the bundled checkpoint.

A conversation is rendered as
    <|bos|><|user_start|>{user}<|user_end|><|assistant_start|>{assistant}<|assistant_end|>...
and a tool-using assistant turn as
    <|python_start|>123*456<|python_end|><|output_start|>56088<|output_end|>123*456 = 56088.
The engine forces <|output_start|>{calculator(expr)}<|output_end|> after <|python_end|>, so those
tokens carry no loss; user turns carry none either. The model learns to copy the result into its answer.
"""

import argparse
import copy
import json
import math
import random
import re
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from nanoserve.tools.calculator import calculator

SPECIALS = [
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
    "<|pad|>",
]
BOS, USER_START, USER_END, ASSISTANT_START, ASSISTANT_END = range(5)
PYTHON_START, PYTHON_END, OUTPUT_START, OUTPUT_END, PAD = range(5, 10)

# System messages are folded into the first user message that follows them (the model has no system role).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{{- '<|bos|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<|user_start|>' + ns.system + message['content'] + '<|user_end|>' -}}{%- set ns.system = '' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|assistant_start|>' + message['content'] + '<|assistant_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}"
)


def render(messages: list[dict]) -> str:
    """The training format; the chat template above must produce exactly this."""
    parts = ["<|bos|>"]
    for m in messages:
        tag = "user" if m["role"] == "user" else "assistant"
        parts.append(f"<|{tag}_start|>{m['content']}<|{tag}_end|>")
    return "".join(parts)


def tool_turn(expr: str, answer: str) -> str:
    """An assistant turn that calls the calculator; `answer` may use {r} for the result."""
    result = calculator(expr)
    assert result is not None, expr
    call = f"<|python_start|>{expr}<|python_end|><|output_start|>{result}<|output_end|>"
    return call + answer.format(r=result)


# ----------------------------------------------------------------------------------------------------
# Synthetic data

# fmt: off
WORDS = """
strawberry banana apple cherry orange lemon mango grape melon peach pear plum kiwi coconut papaya
raspberry blueberry tomato potato carrot onion garlic pepper cucumber pumpkin broccoli spinach lettuce
bread butter cheese coffee chocolate cookie pizza pasta noodle rice sugar honey water milk tea juice
house garden window door kitchen bedroom table chair pillow blanket mirror ceiling floor street city
village mountain river ocean island desert forest jungle valley canyon volcano beach harbor bridge tunnel
elephant giraffe kangaroo penguin dolphin octopus butterfly squirrel rabbit turtle tiger zebra monkey
parrot eagle owl sheep horse donkey camel hippopotamus crocodile mosquito caterpillar alligator gorilla
computer keyboard program python calculator language science history geography mathematics
engineering chemistry physics biology medicine hospital doctor teacher student school library
pencil notebook letter envelope umbrella bicycle airplane helicopter submarine rocket engine wheel
yellow purple green silver golden crimson scarlet turquoise lavender
happy sleepy grumpy excited curious brilliant beautiful wonderful terrible necessary different
occasion accommodate embarrass millennium committee address success possession mississippi
tennessee connecticut massachusetts california banana bookkeeper balloon coffee assessment
summer winter autumn spring monday tuesday wednesday thursday friday saturday sunday january february
december november october september hello goodbye thanks question answer puzzle riddle mystery
""".split()
COUNTRIES = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Canada": "Ottawa", "Egypt": "Cairo", "Russia": "Moscow", "Brazil": "Brasilia",
    "Portugal": "Lisbon", "Greece": "Athens", "Kenya": "Nairobi", "Mexico": "Mexico City",
    "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "India": "New Delhi",
    "Australia": "Canberra", "Argentina": "Buenos Aires", "Peru": "Lima", "Ireland": "Dublin",
    "the United Kingdom": "London", "the United States": "Washington, D.C.",
}
OP_WORDS = {
    "+": ["plus", "+", "+", "added to"],
    "-": ["minus", "-", "-", "take away"],
    "*": ["times", "multiplied by", "*", "*", "x", "×"],
    "/": ["divided by", "/", "/", "÷", "over"],
}
ARITH_TEMPLATES = [
    "What is {e}?", "what is {e}?", "What's {e}?", "what's {e}", "Compute {e}", "Compute {e}.",
    "Calculate {e}", "calculate {e}.", "{e} = ?", "{e}=?", "{e}", "{e}?", "Please compute {e}.",
    "How much is {e}?", "Can you calculate {e}?", "Solve {e}", "What does {e} equal?", "{e} equals?",
    "Quick question: what is {e}?", "Evaluate {e}.", "I need {e}", "what is {e}", "Work out {e}.",
    "Hey, what's {e}?", "Tell me {e}.",
]
PHRASED = {
    "+": ["What is the sum of {a} and {b}?", "Add {a} and {b}.", "What do {a} and {b} add up to?"],
    "-": ["Subtract {b} from {a}.", "What is {a} take away {b}?", "What is {b} less than {a}?"],
    "*": ["What is the product of {a} and {b}?", "Multiply {a} by {b}.", "Multiply {a} and {b}."],
    "/": ["Divide {a} by {b}.", "What is {a} divided by {b}?", "How many times does {b} go into {a}?"],
}
COUNT_TEMPLATES = [
    "How many {l} are in {w}?", "How many {l}'s are in {w}?", "how many {l} in {w}",
    "How many times does the letter {l} appear in {w}?", "Count the letter {l} in {w}.",
    "count {l} in {w}", "In the word {w}, how many {l} are there?", "How many {l}'s does {w} have?",
    "How often does {l} occur in {w}?", "Number of {l} in {w}?", "How many letters {l} are in {w}?",
    "How many {l} does the word {w} contain?",
]
IDENTITY = (
    "I'm nanoserve's tiny assistant, a small language model. "
    "I can chat a little, do arithmetic and count letters with my calculator."
)
CHAT = [
    (["Hi", "Hello", "Hello!", "hi there", "Hey", "hey!", "Good morning", "Good evening", "Hi!", "yo"],
     ["Hello! How can I help you today?", "Hi! Ask me some arithmetic or to count letters in a word."]),
    (["Who are you?", "who are you", "What are you?", "Introduce yourself.", "What is your name?",
      "what's your name?", "Are you a robot?", "Are you human?", "Tell me about yourself."],
     [IDENTITY]),
    (["What can you do?", "Help", "help", "What are you good at?", "How can you help me?"],
     ["I can do arithmetic such as 123*456 and count letters in words, using a calculator. "
      "I can also answer a few simple questions."]),
    (["How are you?", "how are you doing?", "How's it going?", "Are you ok?"],
     ["I'm doing well, thank you! How can I help?"]),
    (["Thanks", "Thank you!", "thanks a lot", "Thank you very much.", "great, thanks"],
     ["You're welcome!", "Happy to help!"]),
    (["Bye", "Goodbye!", "See you later", "bye bye", "Good night"], ["Goodbye! Have a nice day."]),
    (["Who made you?", "Who created you?", "Who trained you?"],
     ["I was trained by the nanoserve project, on synthetic conversations, in a few minutes on a CPU."]),
    (["Tell me a joke.", "Say something funny.", "Do you know a joke?"],
     ["Why did the math book look sad? Because it had too many problems."]),
    (["How many days are in a week?", "How many days does a week have?"], ["A week has 7 days."]),
    (["How many months are in a year?"], ["A year has 12 months."]),
    (["How many legs does a spider have?"], ["A spider has 8 legs."]),
    (["How many legs does a dog have?"], ["A dog has 4 legs."]),
    (["What color is the sky?", "Why is the sky blue?"],
     ["On a clear day the sky is blue, because air scatters blue light more than red light."]),
    (["What is water made of?", "What is the formula of water?"],
     ["Water is made of hydrogen and oxygen: H2O."]),
    (["What is the largest planet?", "Which planet is the biggest?"],
     ["Jupiter is the largest planet in the solar system."]),
    (["What is the boiling point of water?"], ["Water boils at 100 degrees Celsius at sea level."]),
    (["Is the earth flat?", "Is the Earth round?"], ["The Earth is round, close to a sphere."]),
]
REFUSALS = [
    (["What's the weather like today?", "What is the weather in {c}?", "Will it rain tomorrow?",
      "Is it sunny in {c}?", "weather forecast for {c}"],
     "I can't check the weather: I have no internet access or live data."),
    (["Search the web for {t}.", "Google {t} for me.", "Look up {t} online.", "Open the website {t}.com"],
     "I can't browse the internet. I can only answer from what I know, do arithmetic and count letters."),
    (["Describe this image.", "What is in this picture?", "Draw me {t}.", "Generate an image of {t}."],
     "I can't see or make images: I am a small text-only model."),
    (["What time is it?", "What is today's date?", "What day is it today?"],
     "I don't have a clock or a calendar, so I can't tell the time or the date."),
    (["What's the latest news?", "Who won the game last night?", "What is the price of bitcoin?"],
     "I have no access to news or live data."),
    (["Send an email to my boss.", "Call my mom.", "Set an alarm for 7am.", "Play some music.",
      "Order {t} for me."],
     "I can't take actions in the world: I can only chat, do arithmetic and count letters."),
    (["Write me a poem about {t}.", "Write an essay about {t}.", "Translate {t} into French.",
      "Write a program that sorts a list."],
     "Sorry, I'm too small a model to do that well. I can do arithmetic and count letters."),
]
# fmt: on


def number(rng: random.Random) -> int:
    digits = rng.randint(1, 4)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def sp(rng: random.Random) -> str:
    """Optional spacing around an operator, as people type it."""
    return rng.choice(["", " ", " ", ""])


def arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """(user message, calculator expression, final answer) for one arithmetic question."""
    kind = rng.random()
    if kind < 0.2:  # two operations, written with symbols, copied verbatim (spaces dropped)
        ops = [rng.choice("+-*"), rng.choice("+-*")]
        a, b, c = number(rng), number(rng), number(rng)
        expr = f"{a}{ops[0]}{b}{ops[1]}{c}"
        if rng.random() < 0.3:
            expr = f"({a}{ops[0]}{b}){ops[1]}{c}" if rng.random() < 0.5 else f"{a}{ops[0]}({b}{ops[1]}{c})"
        s = sp(rng)
        shown = re.sub(r"(?<=[\d)])([-+*])(?=[\d(])", rf"{s}\1{s}", expr)
        return rng.choice(ARITH_TEMPLATES).format(e=shown), expr, f"{expr} = {{r}}."
    op = rng.choice("+-*/")
    a, b = number(rng), number(rng)
    sym = op
    if op == "/":
        b = rng.randint(1, 99)
        if rng.random() < 0.9:  # mostly exact divisions, a few with a decimal result
            a = b * rng.randint(1, 9999 // b)
        if rng.random() < 0.1:
            sym = "//"
    expr = f"{a}{sym}{b}"
    if kind < 0.35:
        user = rng.choice(PHRASED[op]).format(a=a, b=b)
    else:
        word = sym if sym == "//" else rng.choice(OP_WORDS[op])
        s = sp(rng) if len(word) == 1 else " "
        user = rng.choice(ARITH_TEMPLATES).format(e=f"{a}{s}{word}{s}{b}")
    return user, expr, f"{expr} = {{r}}."


def random_word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))


def counting(rng: random.Random) -> tuple[str, str, str]:
    word = random_word(rng) if rng.random() < 0.2 else rng.choice(WORDS)
    letter = rng.choice(word) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    template = rng.choice(COUNT_TEMPLATES)
    q = "" if "'s" in template else rng.choice(["", "", "'", '"'])
    user = template.format(l=f"{q}{letter}{q}", w=rng.choice([word, f'"{word}"', f"'{word}'"]))
    expr = f'"{word}".count("{letter}")'
    n = word.count(letter)
    answer = f'There {"is" if n == 1 else "are"} {{r}} "{letter}" in "{word}".'
    return user, expr, answer


def chat_turn(rng: random.Random) -> tuple[str, str]:
    r = rng.random()
    if r < 0.25:
        country = rng.choice(list(COUNTRIES))
        q = rng.choice(["What is the capital of {c}?", "capital of {c}?", "What's the capital city of {c}?"])
        return q.format(c=country), f"The capital of {country} is {COUNTRIES[country]}."
    if r < 0.7:
        users, answers = rng.choice(CHAT)
        return rng.choice(users), rng.choice(answers)
    users, answer = rng.choice(REFUSALS)
    topic = rng.choice(["cats", "the moon", "a pizza", "football", "a car", "dogs", "the rain", "a house"])
    return rng.choice(users).format(c=rng.choice(list(COUNTRIES)), t=topic), answer


def single_turn(rng: random.Random, held_out: set[str]) -> list[dict] | None:
    r = rng.random()
    if r < 0.75:
        user, expr, answer = arithmetic(rng) if r < 0.5 else counting(rng)
        if expr in held_out:
            return None
        reply = tool_turn(expr, answer)
    else:
        user, reply = chat_turn(rng)
    return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


def conversations(n: int, seed: int, held_out: set[str]) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        turns = 1 if rng.random() < 0.9 else rng.randint(2, 3)  # some multi-turn chats
        conv = []
        for _ in range(turns):
            conv += single_turn(rng, held_out) or []
        if conv:
            out.append(conv)
    return out


def eval_prompts(seed: int, n: int = 50) -> list[tuple[str, str, str]]:
    """(user message, expression, expected answer): arithmetic and letter counting, 2:1."""
    rng = random.Random(seed)
    items, seen = [], set()
    while len(items) < n:
        user, expr, _ = arithmetic(rng) if len(items) % 3 != 2 else counting(rng)
        if expr not in seen:
            seen.add(expr)
            items.append((user, expr, calculator(expr)))
    return items


# ----------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Digits one by one, so that numbers are copied digit by digit and no merge spans two digits.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,  # ids 0..9, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode(tok: Tokenizer, conv: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and the target mask: 1 on assistant tokens the model must produce."""
    ids = tok.encode(render(conv), add_special_tokens=False).ids
    mask, in_assistant, in_output = [], False, False
    for t in ids:
        if t == ASSISTANT_START:
            in_assistant = True
        elif t == OUTPUT_START:
            in_output = True
        mask.append(int(in_assistant and not in_output and t != ASSISTANT_START))
        if t == ASSISTANT_END:
            in_assistant = False
        elif t == OUTPUT_END:
            in_output = False  # the answer after the tool output is trained again
    return ids, mask


# ----------------------------------------------------------------------------------------------------
# Training


def batches(data: list[tuple[list[int], list[int]]], batch_size: int, rng: random.Random):
    """Right-padded batches of conversations of similar length (causal attention never sees the pad)."""
    order = list(range(len(data)))
    rng.shuffle(order)
    chunk = batch_size * 64
    groups = []
    for i in range(0, len(order), chunk):
        part = sorted(order[i : i + chunk], key=lambda j: len(data[j][0]))
        groups += [part[k : k + batch_size] for k in range(0, len(part), batch_size)]
    rng.shuffle(groups)
    for group in groups:
        width = max(len(data[j][0]) for j in group)
        x = torch.full((len(group), width), PAD)
        y = torch.full((len(group), width), -100)
        for row, j in enumerate(group):
            ids, mask = data[j]
            x[row, : len(ids)] = torch.tensor(ids)
            y[row, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
        yield x, y


@torch.no_grad()
def generate(model: LlamaForCausalLM, ids: list[int], max_new_tokens: int = 96) -> list[int]:
    """Greedy generation with the tool loop: after <|python_end|>, force the calculator's output."""
    ids, start, expr_from = list(ids), len(ids), None
    for _ in range(max_new_tokens):
        t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(t)
        if t in (ASSISTANT_END, BOS):
            break
        if t == PYTHON_START:
            expr_from = len(ids)
        elif t == PYTHON_END and expr_from is not None:
            result = calculator(TOKENIZER.decode(ids[expr_from:-1]))
            if result is not None:
                ids += [OUTPUT_START, *TOKENIZER.encode(result, add_special_tokens=False).ids, OUTPUT_END]
            expr_from = None
    return ids[start:]


TOKENIZER: Tokenizer  # set in main(), used by generate()


def evaluate(model: LlamaForCausalLM, tok: Tokenizer, items: list[tuple[str, str, str]], show: int = 5) -> float:
    model.eval()
    passed = 0
    for i, (user, _, expected) in enumerate(items):
        prompt = tok.encode(
            render([{"role": "user", "content": user}]) + "<|assistant_start|>", add_special_tokens=False
        ).ids
        out = generate(model, prompt)
        text = tok.decode(out, skip_special_tokens=False)
        # The final answer is what follows the tool output; it must contain the expected number.
        answer = text.split("<|output_end|>")[-1] if "<|output_end|>" in text else ""
        ok = re.search(rf"(?<![\d.]){re.escape(expected)}(?![\d]|\.\d)", answer) is not None
        passed += ok
        if i < show or not ok:
            print(f"  {'PASS' if ok else 'FAIL'} {user!r} -> {text!r}")
    model.train()
    return passed / len(items)



def optimizer(model: torch.nn.Module, lr: float, steps: int, warmup: int):
    """AdamW (betas 0.9/0.95, weight decay 0.05 on matrices only) and the learning rate at each step: a linear warm-up,
    then cosine down to 10 %. scripts/train_eagle3_head.py trains its head with the same."""
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )

    def lr_at(s: int) -> float:
        return lr * min(1, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    return opt, lr_at

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "nanoserve" / "assets"))
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--conversations", type=int, default=180_000)
    p.add_argument("--steps", type=int, default=2800)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    # A draft model for speculative decoding must share the target's token ids: reuse its tokenizer.
    p.add_argument("--tokenizer", help="directory with a tokenizer.json to reuse instead of training one")
    # One thread: on a 2-core machine shared with other work, two OpenMP threads wait on each other at
    # every barrier and ran 3-5x slower than one (measured while another process used a core).
    p.add_argument("--threads", type=int, default=1)
    # bf16 halves the file (the draft ships in the wheel); training always keeps fp32 weights.
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    items = eval_prompts(args.seed + 1)
    held_out = {expr for _, expr, _ in items}
    convs = conversations(args.conversations, args.seed, held_out)
    global TOKENIZER
    if args.tokenizer:
        TOKENIZER = tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    else:
        TOKENIZER = tok = train_tokenizer([m["content"] for c in convs[:20_000] for m in c], args.vocab_size)
    data = [encode(tok, c) for c in convs]
    n_tokens = sum(len(ids) for ids, _ in data)
    print(f"data: {len(data)} conversations, {n_tokens} tokens, {time.time() - t0:.0f}s", flush=True)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=ASSISTANT_END,
        pad_token_id=PAD,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(q.numel() for q in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    opt, lr_at = optimizer(model, args.lr, args.steps, warmup=min(200, args.steps // 10))

    rng, step, ema = random.Random(args.seed), 0, None
    while step < args.steps:
        for x, y in batches(data, args.batch_size, rng):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            # bf16 autocast: about 1.5x faster on a CPU with avx512_bf16; the weights stay fp32.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=y).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            step += 1
            if step % 100 == 0 or step == args.steps:
                elapsed = time.time() - t0
                print(f"step {step}/{args.steps} loss {ema:.4f} lr {lr_at(step):.2e} {elapsed:.0f}s", flush=True)
            if step == args.steps:
                break
    train_time = time.time() - t0

    pass_rate = evaluate(model, tok, items)
    save(model, tok, Path(args.out), args.tokenizer, getattr(torch, args.save_dtype))
    check_saved(Path(args.out), model, tok, convs[:500])
    summary = {
        "params_m": round(n_params / 1e6, 2),
        "steps": args.steps,
        "final_loss": round(ema, 4),
        "train_s": round(train_time),
        "eval_pass_rate": pass_rate,
        "total_s": round(time.time() - t0),
    }
    print(json.dumps(summary))


def save(
    model: LlamaForCausalLM,
    tok: Tokenizer,
    out: Path,
    tokenizer_dir: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=[ASSISTANT_END, BOS], pad_token_id=PAD)
    with torch.no_grad():  # round in place, so that check_saved compares with what was saved
        for q in model.parameters():
            q.copy_(q.to(dtype))
    # A copy: .to() would also round the fp32 RoPE frequencies of the model that check_saved runs.
    copy.deepcopy(model).to(dtype).save_pretrained(out)  # the target in fp32: 8.5 MB
    if tokenizer_dir:  # the reused tokenizer's files as they are, chat template included
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(tokenizer_dir) / name, out / name)
        return
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|assistant_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIALS[1:4] + SPECIALS[5:9],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
    hf_tok.save_pretrained(out)
    # transformers 5 writes the template to chat_template.jinja and a config that 4.x cannot read; keep
    # one portable tokenizer_config.json with the template inside, as every version (and nanoserve) reads.
    cfg_path, template_path = out / "tokenizer_config.json", out / "chat_template.jinja"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens", SPECIALS[1:4] + SPECIALS[5:9])
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    template_path.unlink(missing_ok=True)


@torch.no_grad()
def check_saved(out: Path, model: LlamaForCausalLM, tok: Tokenizer, convs: list[list[dict]]) -> None:
    """transformers loads the directory, its chat template reproduces the training tokens, same logits."""
    hf_tok = AutoTokenizer.from_pretrained(out)
    for conv in convs:
        ids = hf_tok.apply_chat_template(conv, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
        assert ids == encode(tok, conv)[0], render(conv)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([encode(tok, convs[0])[0]])
    assert torch.allclose(loaded.float()(x).logits, model.eval()(x).logits, atol=1e-5)
    print(f"checked {out}: loads with transformers, chat template matches on {len(convs)} conversations")


if __name__ == "__main__":
    main()
