"""merged_turns: agent conversations as strict templates take them (no model, milliseconds)."""

from conveyor.server.apis.turns import merged_turns


def test_runs_of_one_role_become_one_turn_and_developer_is_system():
    codex = [{"role": "developer", "content": "A"}, {"role": "developer", "content": "B"},
             {"role": "user", "content": "C"}, {"role": "user", "content": "D"}]
    assert merged_turns(codex) == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "C\n\nD"}]


def test_tool_calls_and_results_are_never_merged():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "r1"}, {"role": "tool", "tool_call_id": "c1", "content": "r2"},
             {"role": "user", "content": ""}, {"role": "user", "content": "next"}]
    assert merged_turns(turns) == turns[:4] + [{"role": "user", "content": "next"}]


def test_turns_with_images_merge_as_parts_in_order():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    turns = [{"role": "user", "content": "first"}, {"role": "user", "content": [image, {"type": "text", "text": "x"}]},
             {"role": "user", "content": "last"}]
    assert merged_turns(turns) == [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "\n\n"}, image, {"type": "text", "text": "x"},
        {"type": "text", "text": "\n\n"}, {"type": "text", "text": "last"}]}]
