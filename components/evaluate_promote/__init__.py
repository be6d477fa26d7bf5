"""evaluate_promote: the KFP component that promotes a candidate model if it beats the promoted one."""
