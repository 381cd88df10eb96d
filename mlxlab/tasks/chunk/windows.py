"""Windows: a conversation read a few messages at a time, for training and for evaluation, and
the windows' answers merged back into one answer for the whole conversation.

Training (`training_windows`) and evaluation (`plan_windows`) read a conversation in windows of
at most `window_messages` consecutive messages, each sharing `window_overlap` with the one
before: at 4 and 2, every window is two exchanges and asks whether the second goes on with the
first's topic. Evaluation fills its windows (`filled_windows`: always that many messages, the
longest cut to fit the token budget), so on alternating chats none ends at a question without
its answer. `merge_local` reads every place a topic may start from the one window that owns it
(`window_cuts`) and sees both sides of it (experiments/chunk_seg4/local-windows.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxlab.tasks.chunk.prompt import (
    TRUNCATED,
    is_user,
    message_block,
    prompt,
    shown,
)
from mlxlab.tasks.chunk.ref import extract_json_ref, resolve_ref


def windows(
    costs: list[int], budget: int, overlap: int, max_messages: int = 0
) -> list[tuple[int, int]]:
    """[(first, last)] message index ranges that cover all messages in order, each costing at most
    `budget` (a message over the budget alone is its own window; `fit` cuts its text) and, when
    `max_messages` is set, holding at most that many messages; each after the first reaches past
    the previous one's end and shares its last `overlap` messages (fewer where they would not fit
    with the next one)."""
    cap = max_messages or len(costs)
    out, start, n = [], 0, len(costs)
    while start < n:
        end, total = start, costs[start]
        while end + 1 < n and total + costs[end + 1] <= budget and end + 1 - start < cap:
            end += 1
            total += costs[end]
        out.append((start, end))
        if end == n - 1:
            break
        # the next window reaches past this one's end, sharing up to `overlap` messages
        start = max(end + 1 - overlap, start + 1)
        while start <= end and (sum(costs[start : end + 2]) > budget or end + 2 - start > cap):
            start += 1
    return out


def fit(message: dict, cost, budget: int) -> dict:
    """`message` with its text cut (marked `TRUNCATED`) until cost(message) <= budget."""
    if cost(message) <= budget:
        return message
    text = message["text"]
    lo, hi = 0, len(text)
    while lo < hi:  # the longest prefix that fits
        mid = (lo + hi + 1) // 2
        if cost({**message, "text": text[:mid] + TRUNCATED}) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return {**message, "text": text[:lo] + TRUNCATED}


def window_cases(
    case: dict, cost, budget: int, overlap: int, max_messages: int = 0
) -> list[tuple[int, int, list[dict]]]:
    """[(first, last, messages)] for the shown messages of `case`: the windows within `budget`
    (cost(message) = its block's share of the prompt) and `max_messages`, over-long messages cut
    to fit."""
    msgs = shown(case["messages"])
    costs = [cost(m) for m in msgs]
    return [
        (a, b, [fit(m, cost, budget) for m in msgs[a : b + 1]])
        for a, b in windows(costs, budget, overlap, max_messages)
    ]


def filled_windows(
    case: dict, cost, budget: int, overlap: int, max_messages: int
) -> list[tuple[int, int, list[dict]]]:
    """`window_cases` for windows of a few messages that always hold `max_messages` of them
    (the conversation's last may hold fewer), each after the first sharing `overlap` with the
    one before: where a window's messages do not fit `budget` together, the longest are cut
    (`fit`) to one common cost, the largest at which the window fits. On a chat that alternates
    from a user message, with `max_messages` and `overlap` even, a window then shows whole
    exchanges however long the answers, where `window_cases` would end it early, at a question
    without its answer. Where a window cannot fit even so (messages cut to nothing would still
    cost more than their share: a budget too small for `max_messages` messages), the case is
    planned by `window_cases`."""
    msgs = shown(case["messages"])
    costs = [cost(m) for m in msgs]
    out = []
    for a, b in windows([1] * len(msgs), max_messages, overlap, max_messages):
        part, own = msgs[a : b + 1], costs[a : b + 1]
        if sum(own) > budget:
            lo, hi = 0, max(own)  # the largest cap on one message's cost that fits them all
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if sum(min(c, mid) for c in own) <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            part = [fit(m, cost, lo) for m in part]
            if any(cost(m) > lo for m, c in zip(part, own, strict=True) if c > lo):
                return window_cases(case, cost, budget, overlap, max_messages)
        out.append((a, b, part))
    return out


def clip(chunks: list[dict], uuids: list[str], first: int, last: int) -> list[dict]:
    """The gold chunks restricted to messages first..last (indices into `uuids`)."""
    index = {u: i for i, u in enumerate(uuids)}
    out = []
    for c in chunks:
        s, e = index[c["start_message_uuid"]], index[c["end_message_uuid"]]
        if e < first or s > last:
            continue
        out.append(
            {
                "start_message_uuid": uuids[max(s, first)],
                "end_message_uuid": uuids[min(e, last)],
                **{k: c[k] for k in ("label", "topic") if k in c},
            }
        )
    return out


def char_cost(m: dict) -> int:
    return len(message_block(m)) + 5


def training_windows(case: dict, cfg) -> list[tuple[list[dict], list[dict]]]:
    """[(messages, gold)] of one case: windows of `window_messages` messages (the last may hold
    fewer), each sharing `window_overlap` with the one before, filled as evaluation fills them
    (`filled_windows`: where a window's messages take more than `window_chars` characters
    together, the longest are cut to fit), with the gold clipped to each."""
    uuids = [m["uuid"] for m in shown(case["messages"])]
    return [
        (msgs, clip(case["chunks"], uuids, a, b))
        for a, b, msgs in filled_windows(
            case, char_cost, cfg.window_chars, cfg.window_overlap, cfg.window_messages
        )
    ]


# Most messages in one window (past what the default 8192-token budget holds; it keeps a
# constrained window's grammar inside llguidance's parser limit of 2000 items per row, which its
# chain of end rules reaches at about 660 messages)
WINDOW_MESSAGES = 500

AUTO_PROMPT_TOKENS = 8192  # the default budget's cap: prefill time and memory grow past it


def max_prompt_tokens(model, settings) -> int:
    """The window budget: `settings.max_prompt_tokens`, or when 0 what the model's context leaves
    after the answer, at most `AUTO_PROMPT_TOKENS`."""
    if getattr(settings, "max_prompt_tokens", 0):
        return settings.max_prompt_tokens
    args = getattr(model, "args", None)
    context = int(getattr(args, "max_position_embeddings", 0) or 0) or AUTO_PROMPT_TOKENS
    return max(256, min(context - settings.max_tokens, AUTO_PROMPT_TOKENS))


@dataclass
class Window:
    case: int
    first: int  # index of its first message among the case's shown messages
    last: int
    uuids: list[str]
    prompt: list[int]
    users: list[str] = field(default_factory=list)  # its user messages' uuids, in order


def plan_windows(
    cases: list[dict],
    tokenizer,
    budget: int,
    overlap: int,
    max_messages: int | None,
) -> list[Window]:
    """Each case's windows, in tokens: with `max_messages` (an adapter's `window_messages`),
    every conversation of more messages read in windows of that many (the last may hold fewer),
    each filled (`filled_windows`: the longest messages cut to one cost until the window fits
    `budget`), so on alternating chats none ends at a question without its answer (a two-exchange
    adapter split 34 of 50 such windows of long exported chats,
    experiments/chunk_seg4/local-windows.md); a case that fits in one window is one prompt.
    `max_messages` None: each case as one prompt if it fits `budget`, else in windows as long as
    the budget allows (`window_cases`; what an adapter of whole conversations was read with: the
    saved answers of those runs re-score with it)."""

    def encode(text: str) -> list[int]:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )

    def cost(m: dict) -> int:
        return len(tokenizer.encode(message_block(m) + "\n---\n", add_special_tokens=False))

    cap = max_messages or WINDOW_MESSAGES
    out = []
    for i, case in enumerate(cases):
        whole = encode(prompt(case))
        msgs = shown(case["messages"])
        if len(whole) <= budget and len(msgs) <= cap:
            out.append(Window(i, 0, len(msgs) - 1, [m["uuid"] for m in msgs], whole, users(msgs)))
            continue
        room = max(budget - len(encode(prompt(case, []))), 16)
        plan = filled_windows if max_messages else window_cases
        for a, b, part in plan(case, cost, room, overlap, cap):
            window = encode(prompt(case, part))
            out.append(Window(i, a, b, [m["uuid"] for m in part], window, users(part)))
    return out


def users(msgs: list[dict]) -> list[str]:
    """The uuids of the user messages among `msgs`, in order."""
    return [m["uuid"] for m in msgs if is_user(m)]


def window_starts(w: Window, case_starts: list[int]) -> list[int]:
    """A case's chunk starts (indices among its shown messages) inside window `w`, numbered from
    the window's first message, which always starts one."""
    return [0] + [s - w.first for s in case_starts if w.first < s <= w.last]


def window_chunks(text: str, uuids: list[str], conversation_uuid):
    """(starts, labels, gap) of one window's answer: `starts` = [(start, label)], sorted, one per
    message (the first chunk the answer starts there), for each chunk whose start anchor resolves
    as `validate_ref` resolves it (of a range whose end also resolves, the lower end), so a chunk
    whose end alone is past saving still says where a topic starts and what it is called;
    `labels` = every chunk's label that is a string, in order. A label that is not a string is
    None. `gap`: the first message after everything the answer covers, when its chunks (some
    anchor resolving) stop before the window's last message; else None (also when a chunk's
    start resolves and its end does not: a mangled anchor). Every training answer covers its
    window to the last message, so one that stops short says the messages after it are not its
    chunks' topic."""
    obj = extract_json_ref(text)
    chunks = obj.get("chunks") if isinstance(obj, dict) else None
    chunks = [c for c in chunks if isinstance(c, dict)] if isinstance(chunks, list) else []
    index = {u: i for i, u in enumerate(uuids)}
    starts: dict[int, str | None] = {}
    labels: list[str] = []
    reached, mangled = -1, False  # the last message any anchor reaches; an end past saving
    for c in chunks:
        lab = c.get("label") if isinstance(c.get("label"), str) else None
        if lab is not None:
            labels.append(lab)
        s, _ = resolve_ref(c.get("start_message_uuid"), uuids, index, conversation_uuid, False)
        e, _ = resolve_ref(c.get("end_message_uuid"), uuids, index, conversation_uuid, True)
        if s is not None:
            starts.setdefault(s if e is None else min(s, e), lab)
            mangled = mangled or e is None
        reached = max(reached, -1 if s is None else s, -1 if e is None else e)
    short = not mangled and 0 <= reached < len(uuids) - 1
    return sorted(starts.items()), labels, reached + 1 if short else None


def window_cuts(windows: list[Window], n_messages: int) -> list[int]:
    """Where each of a case's windows takes over (window k owns messages cuts[k] to
    cuts[k + 1] - 1: from the middle of its overlap with the window before, the earlier window
    keeping the first half rounded up, so every owned message has one message of context before
    it), then `n_messages`."""
    cuts = [0]
    for prev, cur in zip(windows, windows[1:], strict=False):
        cuts.append(min(max((cur.first + prev.last + 2) // 2, cur.first), prev.last + 1))
    return [*cuts, n_messages]


def merge_local(windows: list[Window], texts: list[str], n_messages: int, conversation_uuid):
    """(chunk starts, label per start, failed windows): one cover of messages 0..n_messages-1
    from the answers of a case's windows of a few messages (`window_messages`). Every boundary
    is one window's own decision, about a place it owns (`window_cuts`) and sees both sides of. A
    window's answer starts a topic at a user message it owns (any message, where the window does
    not know its users) when one of its chunks starts there (not at the window's first message,
    which every answer starts with), or when the answer stops short of its last message there
    (`window_chunks`' gap): every training answer covers its window, so one that ends with the
    first exchange says the second is not its topic (what these adapters do at a shift; a
    second chunk is rare, experiments/chunk_seg4/local-windows.md). A window with no start to
    read (failed, counted) decides nothing: the chunk before runs on over what it owns, since a
    label read from a broken answer is no evidence of a new topic. A chunk is called by its own
    answer's label; a start from a short answer (or a label that is not a string) by the first
    window after it that answers with a label, its last labelled chunk starting at or before that
    message, else its first label; with no such window (the conversation's end) the start is
    dropped. Message 0 always starts one, called as window 0 calls it (else as the first window
    with a label does; None when none has). Failed windows are counted among those that own
    messages."""
    cuts = window_cuts(windows, n_messages)
    read = [
        window_chunks(t, w.uuids, conversation_uuid) for w, t in zip(windows, texts, strict=True)
    ]

    def name(k: int, at: int):  # the label the first window from k that has one gives message at
        for w, (starts, own, _) in zip(windows[k:], read[k:], strict=True):
            over = [lab for s, lab in starts if s + w.first <= at and isinstance(lab, str)]
            if over or own:
                return over[-1] if over else own[0]
        return None

    labels: dict[int, str | None] = {}
    for k, (w, (starts, _, gap)) in enumerate(zip(windows, read, strict=True)):
        asks = set(w.users) if w.users else set(w.uuids)
        for s, lab in starts:
            if s > 0 and cuts[k] <= s + w.first < cuts[k + 1] and w.uuids[s] in asks:
                lab = lab if isinstance(lab, str) else name(k + 1, s + w.first)
                if lab is not None:
                    labels[s + w.first] = lab
        if not starts or gap is None or w.uuids[gap] not in asks:
            continue  # failed (no start to read: decides nothing), or no short answer
        at = gap + w.first
        if cuts[k] < at < cuts[k + 1] and at not in labels:
            lab = name(k + 1, at)
            if lab is not None:
                labels[at] = lab
    labels[0] = name(0, 0)
    owners = [r for k, r in enumerate(read) if cuts[k] < cuts[k + 1]]
    return sorted(labels), labels, sum(not starts for starts, _, _ in owners)


# an upper bound on one fixed chunk's tokens: two uuids (a token a character at worst), a label
# of up to 12 words and the keys
FIXED_CHUNK_TOKENS = 160


def fixed_labels(
    windows: list[Window], texts: list[str], starts: list[int], conversation_uuid
) -> dict[int, str | None]:
    """A windowed case's labels under fixed chunk starts (`starts`: indices among its shown
    messages, 0 first; each window decoded under the grammar that starts its chunks exactly
    there): each start called as the window that owns it (`window_cuts`) calls its chunk there;
    where that window's answer cannot be read, as the nearest window that covers the start and
    answered calls its chunk over it; None where none did."""
    cuts = window_cuts(windows, max(w.last for w in windows) + 1)
    read = [
        window_chunks(t, w.uuids, conversation_uuid)[0] for w, t in zip(windows, texts, strict=True)
    ]

    def covering(k: int, at: int):  # window k's chunk over message `at`, or None
        w = windows[k]
        over = [lab for s, lab in read[k] if s + w.first <= at]
        return over[-1] if over and w.first <= at <= w.last else None

    out = {}
    for s in starts:
        owner = next(k for k in range(len(windows)) if cuts[k] <= s < cuts[k + 1])
        order = sorted(range(len(windows)), key=lambda k: (k != owner, abs(k - owner)))
        out[s] = next((lab for k in order if (lab := covering(k, s)) is not None), None)
    return out
