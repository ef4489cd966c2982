# Offline plan-level tests of the module (`terraform test`, mocked AWS provider):
# defaults wire up as documented and bad inputs are refused by validation.

mock_provider "aws" {
  mock_data "aws_partition" {
    defaults = { partition = "aws" }
  }
  mock_data "aws_region" {
    defaults = { name = "eu-west-1" }
  }
  mock_data "aws_caller_identity" {
    defaults = { account_id = "123456789012" }
  }
  mock_data "aws_iam_policy_document" {
    defaults = { json = "{}" }
  }
  mock_resource "aws_s3_bucket" {
    defaults = { arn = "arn:aws:s3:::kvgate-kv-test", id = "kvgate-kv-test" }
  }
  mock_resource "aws_cloudwatch_log_group" {
    defaults = { arn = "arn:aws:logs:eu-west-1:123456789012:log-group:/aws/lambda/kvgate" }
  }
}

variables {
  lambda_zip_path  = "tests/fixtures/empty.zip"
  auth_tokens_json = "{\"tokens\":[]}"
}

run "defaults" {
  command = plan

  assert {
    condition     = aws_lambda_function_url.this.invoke_mode == "RESPONSE_STREAM"
    error_message = "the function URL must stream responses"
  }
  assert {
    condition     = aws_lambda_function.this.runtime == "nodejs22.x" && aws_lambda_function.this.architectures[0] == "arm64"
    error_message = "nodejs22.x on arm64 by default"
  }
  assert {
    condition     = aws_cloudwatch_log_group.this.retention_in_days == 14
    error_message = "log retention must be set"
  }
  assert {
    condition     = one([for r in aws_s3_bucket_server_side_encryption_configuration.this.rule : one(r.apply_server_side_encryption_by_default).sse_algorithm]) == "AES256"
    error_message = "SSE-S3 by default"
  }
  assert {
    condition     = aws_s3_bucket_public_access_block.this.block_public_policy && aws_s3_bucket_public_access_block.this.restrict_public_buckets
    error_message = "the bucket must not be public"
  }
  assert {
    condition     = aws_ssm_parameter.this[0].type == "SecureString" && aws_ssm_parameter.this[0].name == "/kvgate/auth-tokens"
    error_message = "the token table is a SecureString the function reads"
  }
  assert {
    condition     = aws_lambda_function.this.environment[0].variables["KVGATE_AUTH_SSM_PARAMETER"] == "/kvgate/auth-tokens"
    error_message = "the function is told where the token table is"
  }
  assert {
    condition     = aws_lambda_function.this.environment[0].variables["KVGATE_STAGING_PREFIX"] == "kv-staging" && aws_lambda_function.this.environment[0].variables["KVGATE_UPLOAD_MIN_BYTES"] == "1048576"
    error_message = "presigned uploads stage beside the chunk prefix, from 1 MiB"
  }
  assert {
    condition     = one([for r in aws_s3_bucket_lifecycle_configuration.this.rule : r.expiration[0].days if r.id == "kv-upload-staging"]) == 1 && one([for r in aws_s3_bucket_lifecycle_configuration.this.rule : one(r.filter).prefix if r.id == "kv-upload-staging"]) == "kv-staging/"
    error_message = "uncommitted staged uploads expire after a day"
  }
}

run "kms_and_existing_parameter" {
  command = plan

  variables {
    kms_key_arn         = "arn:aws:kms:eu-west-1:123456789012:key/0000-1111"
    auth_parameter_name = "/ops/kvgate/tokens"
    auth_tokens_json    = null
  }

  assert {
    condition     = one([for r in aws_s3_bucket_server_side_encryption_configuration.this.rule : one(r.apply_server_side_encryption_by_default).sse_algorithm]) == "aws:kms"
    error_message = "a KMS key switches the bucket to SSE-KMS"
  }
  assert {
    condition     = length(aws_ssm_parameter.this) == 0
    error_message = "an existing parameter is used, not created"
  }
}

run "rejects_public_storage_class_mistakes" {
  command = plan

  variables {
    cold_tier_storage_class   = "STANDARD_IA"
    cold_tier_transition_days = 7
  }

  expect_failures = [var.cold_tier_storage_class]
}

run "rejects_expiry_before_transition" {
  command = plan

  variables {
    cold_tier_transition_days = 60
    expiration_days           = 30
  }

  expect_failures = [var.expiration_days]
}

run "rejects_missing_auth" {
  command = plan

  variables {
    auth_tokens_json = null
  }

  expect_failures = [var.auth_parameter_name]
}

run "rejects_oversized_chunks" {
  command = plan

  variables {
    max_chunk_bytes = 8388608
  }

  expect_failures = [var.max_chunk_bytes]
}

run "function_url_permissions" {
  command = plan

  assert {
    condition     = aws_lambda_permission.this["url"].action == "lambda:InvokeFunctionUrl" && aws_lambda_permission.this["url"].function_url_auth_type == "NONE"
    error_message = "the URL needs a public InvokeFunctionUrl grant"
  }
  assert {
    condition     = aws_lambda_permission.this["invoke"].action == "lambda:InvokeFunction"
    error_message = "function URLs created since October 2025 also need lambda:InvokeFunction"
  }
}

run "function_url_permissions_opt_out" {
  command = plan

  variables {
    create_invoke_function_permission = false
  }

  assert {
    condition     = keys(aws_lambda_permission.this) == ["gc", "url"]
    error_message = "opting out leaves only the URL grant (and the scheduled gc's)"
  }
}

run "scheduled_gc" {
  command = plan

  variables {
    namespace_policies = {
      prod = { retention = "30d", quota = "500GiB" }
      "*"  = { retention = "90d" }
    }
  }

  assert {
    condition     = aws_cloudwatch_event_rule.this[0].schedule_expression == "rate(1 hour)"
    error_message = "gc runs hourly by default"
  }
  assert {
    condition     = aws_cloudwatch_event_target.this[0].input == jsonencode({ kvgate = "gc" })
    error_message = "the schedule sends the event the handler recognises"
  }
  assert {
    condition     = aws_lambda_permission.this["gc"].principal == "events.amazonaws.com"
    error_message = "only EventBridge gets the gc grant"
  }
  assert {
    condition     = jsondecode(aws_lambda_function.this.environment[0].variables["KVGATE_COLD_TIER"]) == { grace = "10m", namespaces = { prod = { retention = "30d", quota = "500GiB" }, "*" = { retention = "90d" } } }
    error_message = "namespace policies reach the function as KVGATE_COLD_TIER"
  }
}

run "scheduled_gc_off" {
  command = plan

  variables {
    gc_schedule_expression = null
  }

  assert {
    condition     = length(aws_cloudwatch_event_rule.this) == 0 && !contains(keys(aws_lambda_permission.this), "gc")
    error_message = "gc_schedule_expression = null schedules nothing"
  }
}

run "intelligent_tiering_from_creation" {
  command = plan

  variables {
    cold_tier_storage_class   = "INTELLIGENT_TIERING"
    cold_tier_transition_days = 0
  }

  assert {
    condition     = one(flatten([for r in aws_s3_bucket_lifecycle_configuration.this.rule : [for t in r.transition : "${t.storage_class}@${t.days}"]])) == "INTELLIGENT_TIERING@0"
    error_message = "objects move to Intelligent-Tiering"
  }
}

run "rejects_day_zero_for_ia" {
  command = plan

  variables {
    cold_tier_storage_class   = "STANDARD_IA"
    cold_tier_transition_days = 0
  }

  expect_failures = [var.cold_tier_storage_class]
}

run "rejects_bad_namespace_policy" {
  command = plan

  variables {
    namespace_policies = { prod = { quota = "lots" } }
  }

  expect_failures = [var.namespace_policies]
}

run "upload_ttl_is_bounded" {
  command = plan

  variables {
    upload_ttl_seconds = 10
  }

  expect_failures = [var.upload_ttl_seconds]
}
