"""Reports (Spark over JDBC): where the store is read from, how, and where reports go."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator

from orderly.worker.settings._base import Section


class ReportSettings(Section):
    report_jdbc_url: str | None = Field(
        None,
        validation_alias="ORDERLY_REPORT_JDBC_URL",
        description="jdbc:postgresql:// URL Spark reads (default: from ORDERLY_DATABASE_URL).",
    )
    report_jdbc_user: str | None = Field(
        None,
        validation_alias="ORDERLY_REPORT_JDBC_USER",
        description="Database user of the report (default: the one of ORDERLY_DATABASE_URL).",
    )
    report_jdbc_password: SecretStr | None = Field(
        None,
        validation_alias="ORDERLY_REPORT_JDBC_PASSWORD",
        description="Its password (default: the one of ORDERLY_DATABASE_URL).",
    )
    report_jdbc_jar: str = Field(
        "/usr/share/java/postgresql.jar",
        min_length=1,
        validation_alias="ORDERLY_REPORT_JDBC_JAR",
        description="The PostgreSQL JDBC driver jar (Debian: libpostgresql-jdbc-java).",
    )
    report_partitions: int = Field(
        4,
        ge=1,
        le=1024,
        validation_alias="ORDERLY_REPORT_PARTITIONS",
        description="Partitions of each large JDBC read (ranges of the table's id).",
    )
    report_fetchsize: int = Field(
        10_000,
        ge=1,
        validation_alias="ORDERLY_REPORT_FETCHSIZE",
        description="Rows per JDBC round trip.",
    )
    report_master: str = Field(
        "local[*]",
        min_length=1,
        validation_alias="ORDERLY_REPORT_MASTER",
        description="Spark master: local[*], or a cluster's URL (spark://..., yarn, k8s://...).",
    )
    report_driver_memory: str = Field(
        "2g",
        pattern=r"^[0-9]+[kmgt]$",
        validation_alias="ORDERLY_REPORT_DRIVER_MEMORY",
        description="Spark driver memory (local mode: all of Spark).",
    )
    report_executor_memory: str = Field(
        "1g",
        pattern=r"^[0-9]+[kmgt]$",
        validation_alias="ORDERLY_REPORT_EXECUTOR_MEMORY",
        description="Memory of each executor on a cluster (not used by local[*]).",
    )
    report_executor_cores: int = Field(
        1,
        ge=1,
        le=256,
        validation_alias="ORDERLY_REPORT_EXECUTOR_CORES",
        description="Cores of each executor on a cluster (not used by local[*]).",
    )
    report_quick_jit: bool = Field(
        True,
        validation_alias="ORDERLY_REPORT_QUICK_JIT",
        description="Spark's JVMs compile with C1 only: faster up to a few million rows; "
        "false for long reports (tens of millions of rows). A cluster's driver, which runs no "
        "tasks, compiles with C1 only either way.",
    )
    report_output_dir: str = Field(
        "reports-out",
        min_length=1,
        validation_alias="ORDERLY_REPORT_OUTPUT_DIR",
        description="Where reports are written, one folder per run.",
    )
    report_nightly_hour: int | None = Field(
        None,
        ge=0,
        le=23,
        validation_alias="ORDERLY_REPORT_NIGHTLY_HOUR",
        description="If set, beat runs an incremental report every day at this hour (UTC).",
    )

    @field_validator("report_jdbc_url")
    @classmethod
    def _jdbc_postgres(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("jdbc:postgresql://"):
            raise ValueError(
                "ORDERLY_REPORT_JDBC_URL must be a jdbc:postgresql://host:port/database URL, "
                f"got {value.split('?', 1)[0]!r}"
            )
        return value
