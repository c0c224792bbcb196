"""The slow tier: tests CI leaves to `python -m pytest -q -n 2 -m slow` (tests/conftest.py marks
them). Each is a longer variant of a path a test CI runs already takes; the comment of each group
names that test. Chosen by `--durations` of the whole suite (docs/testing.md): the slow tier is
about two thirds of the suite's time. An entry is the start of test ids: a whole test, or some of
its parameters; tests/test_budget.py checks that every entry still names a test.
"""

SLOW = (
    # Tools for the GPU and benchmarks, run on the CPU, and longer variants of checks CI makes at
    # a smaller size (CI: tests/test_gpu_run_cli.py; the Gumbel noise finite at Qwen's vocabulary,
    # the sampled frequencies at a small one; the import structure of methods/; SFPO degenerate at
    # alpha 1; get_lr's warm-up in test_train)
    "tests/test_scale.py::test_gpu_run_dry_run_passes_every_step_on_the_cpu",
    "tests/test_scale.py::test_gpu_check_logic_on_the_cpu",
    "tests/test_scale.py::test_real_model_settings_run_train",
    "tests/test_scale.py::test_real_model_settings_update[compile]",
    "tests/test_generation_memory.py",
    "tests/test_budget.py::test_a_method_that_is_on_is_in_the_step",
    "tests/test_compare.py::test_plateau_check_on_hand_made_curves",
    "tests/test_decode.py::test_refill_draws_stay_in_the_top_k_and_top_p_support_at_a_real_voca",
    "tests/test_decode.py::test_gumbel_max_frequencies_match_the_distribution_at_a_real_vocabul",
    "tests/test_decode.py::test_compiled_decode_step_samples_what_the_eager_one_does",
    "tests/test_budget.py::test_an_ordinary_default_step_runs_four_support_modules_and_no_method",
    "tests/test_lookahead.py::test_degenerate_lookahead_is_grpo_bit_for_bit[degenerate1",
    "tests/test_rollout.py::test_warmup_counts_generation_steps_whatever_the_minibatches",
    # Resume after SIGKILL / SIGTERM of each method and setting (CI: test_epochs' SIGKILL inside
    # the passes, test_preempt's SIGTERM during a generation, test_integrity_content's resume of a
    # checkpoint its manifest vouches for)
    "tests/test_scale.py::test_fsdp_sigkill_then_resume_is_bit_identical",
    "tests/test_scale.py::test_torchrun_train_logs_on_rank0_checkpoints_and_resumes",
    "tests/test_stage_skip_runs.py::test_skip_and_stages_resume_after_sigkill_is_bit_identical",
    "tests/test_decode.py::test_refill_trains_through_train_py_and_resumes_bit_for_bit",
    "tests/test_lookahead.py::test_lookahead_sigkill_inside_the_passes_then_resume_is_bit_i"
    "dentical",
    "tests/test_lora.py::test_lora_sigkill_then_resume_is_bit_identical",
    "tests/test_checkpoint.py::test_resume_continues_the_same_wandb_run",
    "tests/test_checkpoint.py::test_kill_inside_checkpoint_write_resumes_from_the_newest_complete",
    "tests/test_checkpoint.py::test_damaged_latest_checkpoint_names_the_newest_intact_one",
    "tests/test_checkpoint.py::test_damaged_checkpoints_name_the_newest_intact_not_the_oldest",
    "tests/test_checkpoint.py::test_sigint_stops_with_one_line",
    "tests/test_preempt.py::test_torchrun_",
    "tests/test_preempt.py::test_sigterm_during_an_update_of_many_passes_stops_between_steps_and"
    "_resume_is_bit_identical[epochs]",
    "tests/test_checkpoint.py::test_sigterm_checkpoints_the_current_step_and_resume_is_bit_identic",
    "tests/test_checkpoint.py::test_sigkill_mid_run_then_resume_is_bit_identical",
    "tests/test_checkpoint.py::test_eval_writes_into_the_run_and_never_overwrites",
    "tests/test_lora.py::test_lora_checkpoints_hold_the_adapters_alone",
    "tests/test_preempt.py::test_a_signal_during_set_up_ends_it_at_once_and_leaves_out_dir_"
    "as_it_was"
    "[new-15]",
    "tests/test_preempt.py::test_sigterm_during_a_generation_with_skipping_on_resumes_bit_i"
    "dentical",
    "tests/test_preempt.py::test_sigterm_during_a_long_eval_checkpoints_its_step_and_resume_is_bit",
    "tests/test_preempt.py::test_sigterm_during_a_long_generation_abandons_the_step_and_resume_is_"
    "bit_identical[dynamic_sampling_round_2]",
    "tests/test_preempt.py::test_sigterm_during_the_first_eval_checkpoints_step_0_and_resum"
    "e_is_bit",
    "tests/test_preempt.py::test_sigterm_during_eval_py_writes_the_finished_problems_marked"
    "_partial",
    "tests/test_preempt.py::test_a_signal_during_set_up_ends_it_at_once_and_leaves_out_dir_"
    "as_it_was"
    "[overwrite-15]",
    "tests/test_preempt.py::test_a_signal_during_set_up_ends_it_at_once_and_leaves_out_dir_"
    "as_it_was"
    "[resume-2]",
    # Several processes (CI: test_scale's first update under torchrun, DDP and FSDP)
    "tests/test_distributed.py",
    "tests/test_epochs.py::test_torchrun_epochs_2_update_equals_single_process",
    "tests/test_lora.py::test_lora_torchrun_",
    "tests/test_logprobs.py::test_fsdp_reshard_settings_restored_after_generation",
    "tests/test_scale.py::test_fsdp_generation_runs_without_fsdp_hooks_and_samples_the_same"
    "[float32]",
    "tests/test_scale.py::test_fsdp_generation_runs_without_fsdp_hooks_and_samples_the_same"
    "[bfloat16]",
    # LoRA with each strategy (CI: with none, and every strategy without LoRA)
    "tests/test_lora.py::test_lora_runs_with_every_replay_strategy[aper]",
    "tests/test_lora.py::test_lora_runs_with_every_replay_strategy[dynamic]",
    "tests/test_lora.py::test_lora_runs_with_every_replay_strategy[exgrpo]",
    "tests/test_lora.py::test_lora_runs_with_every_replay_strategy[group]",
    "tests/test_lora.py::test_lora_runs_with_every_replay_strategy[rlep]",
    "tests/test_lora.py::test_lora_runs_with_every_replay_strategy[uniform]",
    # Every tiny config for 3 steps: the composed and learning-rate arms (CI: every strategy, and
    # SFPO, staged rollouts, skipping, dynamic sampling alone; GXPO in test_lookahead)
    "tests/test_smoke.py::test_every_tiny_config_runs[gated]",
    "tests/test_smoke.py::test_every_tiny_config_runs[epochs",
    "tests/test_smoke.py::test_every_tiny_config_runs[gxpo_nogate",
    "tests/test_smoke.py::test_every_tiny_config_runs[none_lr",
    "tests/test_smoke.py::test_every_tiny_config_runs[skip_",
    "tests/test_smoke.py::test_every_tiny_config_runs[lora]",
    "tests/test_smoke.py::test_every_tiny_config_runs[gxpo]",
    # More cases of one refusal, and refusals whose rule another CI test exercises (CI: one case of
    # each family)
    "tests/test_folders_env.py::test_eval_never_writes_into_a_run_folders_root[checkpoints-",
    "tests/test_folders_env.py::test_eval_never_writes_into_a_run_folders_root[final/x-compare]",
    "tests/test_folders_env.py::test_eval_never_writes_into_a_run_folders_root[-",
    "tests/test_folders_env.py::test_torchrun_variables_without_torchrun_are_one_line[local_rank]",
    "tests/test_folders_env.py::test_torchrun_variables_without_torchrun_are_one_line[part]",
    "tests/test_folders_env.py::test_torchrun_variables_without_torchrun_are_one_line[stale]",
    "tests/test_folders_env.py::test_torchrun_variables_without_torchrun_are_one_line[text]",
    "tests/test_folders_env.py::test_two_evals_into_one_out_dir_the_second_is_refused",
    "tests/test_folders_env.py::test_overwrite_through_a_symlinked_out_dir",
    "tests/test_folders_env.py::test_a_lock_that_is_no_regular_file_is_refused_and_nothing_it_name"
    "s_changes[fifo]",
    "tests/test_folders_env.py::test_a_lock_that_is_no_regular_file_is_refused_and_nothing_it_name"
    "s_changes[symlink]",
    "tests/test_folders_env.py::test_a_wandb_mode_wandb_does_not_know_is_one_line_and_nothing_wr",
    "tests/test_folders_env.py::test_a_run_is_not_started_on_a_folder_an_eval_writes_into",
    "tests/test_folders_env.py::test_an_eval_lock_that_is_a_symlink_is_refused",
    "tests/test_folders_env.py::test_sigterm_during_the_rendezvous_stops_at_once",
    "tests/test_integrity_content.py::test_a_problem_with_two_golds_or_a_blank_one_is_refused_at_lo"
    "ad[bom_answer]",
    "tests/test_integrity_content.py::test_a_problem_with_two_golds_or_a_blank_one_is_refused_at_lo"
    "ad[two_golds_spaced]",
    "tests/test_integrity_content.py::test_a_problem_with_two_golds_or_a_blank_one_is_refused_at_lo"
    "ad[zero_width_",
    "tests/test_integrity_content.py::test_a_checkpoint_file_changed_at_its_size_is_refused",
    "tests/test_integrity_content.py::test_a_checkpoint_its_manifest_does_not_vouch_for_is_refused"
    "[empty]",
    "tests/test_integrity_content.py::test_a_checkpoint_its_manifest_does_not_vouch_for_is_refused"
    "[extra_file]",
    "tests/test_integrity_content.py::test_a_checkpoint_its_manifest_does_not_vouch_for_is_refused"
    "[listed_absent]",
    "tests/test_integrity_content.py::test_a_checkpoint_its_manifest_does_not_vouch_for_is_refused"
    "[no_sha256]",
    "tests/test_integrity_content.py::test_a_checkpoint_its_manifest_does_not_vouch_for_is_refused"
    "[skip_state]",
    "tests/test_integrity_content.py::test_a_checkpoint_its_manifest_does_not_vouch_for_is_refused"
    "[swap]",
    "tests/test_integrity_content.py::test_a_training_file_rewritten_in_place_is_refused_at_resume",
    "tests/test_integrity_content.py::test_an_older_layout_with_a_manifest_of_sizes_is_called_that",
    "tests/test_bad_input_rules.py::test_eval_refuses_a_model_with_weights_not_finite[inf]",
    "tests/test_bad_input_rules.py::test_a_model_folder_not_whole_is_one_line[tensor-words0"
    "-eval.py]",
    "tests/test_bad_input_rules.py::test_a_model_folder_not_whole_is_one_line[tokenizer-",
    "tests/test_bad_input_rules.py::test_comparison_refuses_numbers_outside_their_domain[args1",
    "tests/test_bad_input_rules.py::test_comparison_refuses_numbers_outside_their_domain[args2",
    "tests/test_bad_input_rules.py::test_comparison_refuses_numbers_outside_their_domain[args3",
    "tests/test_bad_input_rules.py::test_train_refuses_domains_still_open_in_one_line[args1",
    "tests/test_bad_input_rules.py::test_train_refuses_domains_still_open_in_one_line[args2",
    "tests/test_bad_input_rules.py::test_train_refuses_domains_still_open_in_one_line[args3",
    "tests/test_bad_input_rules.py::test_resume_of_a_state_beyond_any_run_is_one_line",
    "tests/test_bad_input_rules.py::test_resume_refuses_a_checkpoint_its_manifest_says_is_n"
    "ot_whole",
    "tests/test_checkpoint.py::test_eval_bad_input_is_one_line[args1",
    "tests/test_checkpoint.py::test_eval_bad_input_is_one_line[args3",
    "tests/test_checkpoint.py::test_eval_bad_input_is_one_line[args4",
    "tests/test_bad_input.py::test_bad_input_chat_template_end_to_end_and_debug",
    "tests/test_bad_input.py::test_bad_input_bombs_end_to_end_and_debug",
    "tests/test_bad_input_env.py::test_a_non_ascii_path_under_an_ascii_locale_trains_and_resumes",
    "tests/test_bad_input_env.py::test_resume_on_a_disk_too_full_for_a_checkpoint_is_refused_alone",
    "tests/test_bad_input_env.py::test_a_hub_id_out_of_reach_fails_at_once_in_one_line[no_network]",
    "tests/test_bad_input_env.py::test_a_lock_names_the_holder_that_is_known[self]",
    "tests/test_compare.py::test_compare_names_the_library_versions_and_refuses_to_pool_two",
    "tests/test_compare.py::test_compare_refuses_an_arm_that_measures_something_else",
    "tests/test_compare.py::test_compare_counts_each_run_once",
    "tests/test_bad_input_rules.py::test_two_runs_started_together_on_one_folder_one_runs",
    "tests/test_bad_input_env.py::test_a_path_holding_a_newline_is_refused_in_one_line",
    "tests/test_bad_input.py::test_bad_input_rlep_source_end_to_end_and_debug",
    "tests/test_folders_env.py::test_a_lock_that_is_no_regular_file_is_refused_and_nothing_it_name"
    "s_changes[folder]",
    "tests/test_folders_env.py::test_torchrun_variables_without_torchrun_are_one_line[rank]",
    "tests/test_checkpoint.py::test_eval_bad_input_is_one_line[args2",
    "tests/test_integrity_content.py::test_a_checkpoint_its_manifest_does_not_vouch_for_is_refused"
    "[unlisted]",
    "tests/test_bench_cli.py::test_bad_input_as_the_user_runs_it[keep_runs.py]",
    "tests/test_bench_cli.py::test_bad_input_as_the_user_runs_it[generation.py]",
)


def slow(nodeid: str) -> bool:
    return nodeid.startswith(SLOW)
