"""What answers on the network: the verbs' WSGI path (`app`), the admission webhook and its
process, and the listeners' budgets. Imports the verbs and the state; nothing below imports it."""
