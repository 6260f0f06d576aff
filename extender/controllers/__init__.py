"""The loops that act on the cluster on their own: preemption, autoscale placeholders, the
requeuer and janitor threads, and the defragmenter (its own command). They drive the verbs'
facade and read the view; nothing below imports them."""
