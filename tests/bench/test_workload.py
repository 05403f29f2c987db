from conveyor.bench.workload import PromptSource, Workload, file_prompts, load_prompt_file, synthetic_prompts


def test_synthetic_prompts_deterministic_distinct_and_sized():
    a = synthetic_prompts(16, 100, seed=1)
    assert a == synthetic_prompts(16, 100, seed=1)
    assert len(set(a)) == 16
    assert {len(p.split()) for p in a} == {100}
    assert synthetic_prompts(16, 100, seed=2) != a
    assert set(synthetic_prompts(16, 100, seed=1, stream=1)).isdisjoint(a)
    assert len({p.split()[0] for p in a}) > 1  # no shared first word for a prefix cache to exploit


def test_prompt_file_paragraphs_then_lines(tmp_path):
    paragraphs = tmp_path / "p.txt"
    paragraphs.write_text("first para\nstill first\n\nsecond\n\n\nthird\n")
    assert load_prompt_file(paragraphs) == ["first para\nstill first", "second", "third"]
    lines = tmp_path / "l.txt"
    lines.write_text("one\ntwo\n\n")
    assert load_prompt_file(lines) == ["one", "two"]
    assert file_prompts(["a", "b", "c"], 4, offset=2) == ["c", "a", "b", "c"]


def test_workload_specs_carry_sampling():
    workload = Workload(PromptSource(num_tokens=8, seed=0), max_tokens=5, temperature=0.5, ignore_eos=True)
    specs = workload.specs(3, stream=1)
    assert len(specs) == 3 and all(s.max_tokens == 5 and s.ignore_eos and s.temperature == 0.5 for s in specs)
    pooled = Workload(PromptSource(8, 0, pool=("x", "y")), max_tokens=1)
    assert [s.prompt for s in pooled.specs(3, stream=0)] == ["x", "y", "x"]
