"""The audit report: every statistic and figure of the paper's mechanism analysis, from dumps.

- :mod:`~icsd_audit.report.results` -- :class:`ReportOptions` and the frozen :class:`AuditReport`;
- :mod:`~icsd_audit.report.build` -- :func:`audit_dumps` (compute) and :func:`write_report`,
  :func:`write_figures` (write every file atomically);
- :mod:`~icsd_audit.report.render` -- tables, Markdown and the self-contained HTML page;
- :mod:`~icsd_audit.report.figures` -- one function per paper figure: result object in, Figure out.
"""
